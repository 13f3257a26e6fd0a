"""The command line as a user runs it: subprocesses, a tiny model, real sockets on loopback."""

from __future__ import annotations

import builtins
import importlib
import io
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import pytest

from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.text.tokenizer import Tokenizer
from helpers.tiny import random_weights, tiny_config, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    cfg = tiny_config("llama", context=256)
    return write_gguf(d / "tiny.gguf", cfg, random_weights(cfg, seed=3))


def meshinfer(*args: str, timeout: float = 120, env: dict | None = None, stdin: str | None = None
              ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, input=stdin)


def expected_tokens(path, text: str, n: int) -> list[int]:
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode_chat([{"role": "user", "content": text}])
    return greedy_generate(load_shard(path), ids, max_tokens=n, eos_ids=tok.eos_ids).token_ids


@pytest.mark.slow
def test_generate_json(tiny_gguf):
    out = meshinfer("generate", "--model", str(tiny_gguf), "-p", "hello", "--max-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert set(d) >= {"prompt_ids", "token_ids", "text", "finish_reason", "ttft_ms", "decode_tokens_per_s"}
    assert d["token_ids"] == expected_tokens(tiny_gguf, "hello", 6)
    assert d["finish_reason"] in ("stop", "length")


def free_port_base(count: int) -> int:
    """A loopback port p such that p .. p+count-1 were all free just now (bench peers and proxies)."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports found")


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["join", "--layers", "30-40"], "layer range 30-40 is outside the model: it has 4 layers (0-3)"),
    (["join", "--layers", "3-1"], "is empty: last layer 1 < first layer 3"),
    (["generate", "-p", "x", "--model", "no-such-model"], "no-such-model"),
    (["generate", "-p", "x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["chat", "-p", "x", "--peers", "ws://127.0.0.1:1"], "no bootstrap peer answered"),
    (["chat", "-p", "x", "--peers", "ws://127.0.0.1:1", "--draft-tokens", "0"], "--draft-tokens must be 1-31, got 0"),
    (["chat", "-p", "x", "--peers", "ws://127.0.0.1:1", "--mesh-key-file", "/nonexistent/mesh.key"],
     "--mesh-key-file /nonexistent/mesh.key: No such file or directory"),
    (["join", "--max-batch", "0"], "--max-batch must be at least 1 (1 turns batching off), got 0"),
    (["join", "--batch-wait-ms", "-5"], "--batch-wait-ms must be 0-1000 (0: never wait), got -5.0"),
    (["chat", "-p", "x", "--peers", "127.0.0.1:7850"], "peer address '127.0.0.1:7850' is not ws://HOST:PORT or "
                                                       "wss://HOST:PORT (what a peer's ready: line shows)"),
    (["join", "--metrics-port", "9", "--metrics-host", "192.0.2.1"], "cannot listen on 192.0.2.1:9:"),
    (["join", "--listen", "0.0.0.0:0"], "refusing to listen on 0.0.0.0 without TLS: pass --tls self-signed "
                                        "(or --tls-cert/--tls-key), or --insecure to serve plain ws://"),
    (["chat", "-p", "x", "--peers", "ws://10.0.0.5:7700"], "ws://10.0.0.5:7700 is plain ws:// to another "
                                                           "machine: frames would travel unencrypted"),
    # found by a new-user run: join loaded the weights, said ready, then retried this every 2 s
    (["join", "--layers", "0-1", "--peers", "ws://10.1.2.3:9510"], "ws://10.1.2.3:9510 is plain ws:// to another "
                                                                   "machine"),
    (["join", "--layers", ""], "--layers is empty: give an inclusive range such as 0-11, or auto"),
])
def test_user_mistakes_give_one_line_errors(tiny_gguf, args, message):
    if "--model" not in args and args[0] != "chat":
        args = args + ["--model", str(tiny_gguf)]
    if args[0] == "join" and "--listen" not in args:
        args = args + ["--listen", "127.0.0.1:0"]  # the default port may be taken on this machine
    out = meshinfer(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_bad_draft_model_is_refused_before_any_peer_is_contacted(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    for path, message in ((tmp_path / "missing.gguf", "error: draft model: model "),
                          (bad, f"error: draft model {bad}: cannot load it: ")):
        # port 1: nothing listens there, so contacting a peer would fail with another error
        out = meshinfer("chat", "--peers", "ws://127.0.0.1:1", "-p", "hi", "--json", "--draft-model", str(path))
        assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(message), out.stderr
    # found by a new-user run: these were all accepted, the model loaded, then ignored or refused late
    cases = ((("--draft-device", "tpu"), "error: draft model: device 'tpu' is not one of"),
             (("--no-speculate",), "note: --draft-model"),  # not loaded (the file is corrupt): then no route
             (("--temperature", "0.7"), "note: --draft-model"))
    for extra, message in cases:
        out = meshinfer("chat", "--peers", "ws://127.0.0.1:1", "-p", "hi", "--draft-model", str(bad), *extra)
        assert message in out.stderr and "cannot load it" not in out.stderr, out.stderr
    out = meshinfer("chat", "--peers", "ws://127.0.0.1:1", "-p", "hi", "--draft-model", str(bad),
                    env={**os.environ, "MESHINFER_DRAFT_AHEAD": "maybe"})
    assert out.returncode == 2 and "--draft-ahead (or $MESHINFER_DRAFT_AHEAD) must be" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_gguf_peer_answers_the_same_after_its_model_file_is_truncated(tmp_path):
    """A gguf peer holds its own copy of the file's blocks (GGUFFile.iter_shard_tensors): a model
    file truncated in place under a running `join` neither kills it (SIGBUS on a mapped page,
    exit 135) nor changes its answers."""
    import gguf

    model = tmp_path / "model.gguf"
    cfg = tiny_config("qwen2", context=256)
    write_gguf(model, cfg, random_weights(cfg, seed=3),
               quantize=lambda name: gguf.GGMLQuantizationType.Q8_0 if name.endswith("proj.weight") else None)
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(model), "--dtype", "gguf",
                             "--listen", "127.0.0.1:0", "--key", str(tmp_path / "k.pem")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (ws://127\.0\.0\.1:\d+)", line)
        assert m, line + (proc.stderr.read() if proc.poll() is not None else "")

        def answer() -> list[int]:
            out = meshinfer("chat", "--peers", m.group(1), "-p", "hello", "--max-tokens", "6", "--json",
                            "--no-speculate", env=env)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)["token_ids"]

        before = answer()
        with open(model, "r+b") as fh:
            fh.truncate(4096)
        assert answer() == before and len(before) == 6
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_join_status_chat_and_sigterm(tiny_gguf, tmp_path):
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf),
                             "--listen", "127.0.0.1:0", "--key", str(tmp_path / "k.pem")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"ready: peer (\w+) serving layers 0-3 of 4 at (ws://127\.0\.0\.1:\d+)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        url = m.group(2)
        status = meshinfer("status", "--peers", url, "--json", env=env)
        assert status.returncode == 0, status.stderr
        table = json.loads(status.stdout)
        assert [p["peer_id"] for p in table["peers"]] == [m.group(1)]  # join prints the full id
        assert table["routes"][0]["route"][0]["layers"] == "0-3"
        assert meshinfer("status", "--peers", url, "--require-route", env=env).returncode == 0
        tls = meshinfer("status", "--peers", url.replace("ws://", "wss://"), env=env)
        assert tls.returncode == 2 and tls.stderr.strip().splitlines()[-1].endswith(
            "if the peer serves plain websockets, use ws://"), tls.stderr
        repl = meshinfer("chat", "--peers", url, "--max-tokens", "3", "--no-speculate", "--context", "256", env=env,
                         stdin="/help\n/bogus\n\n//x\n" + "y" * 4000 + "\n" + "z" * 1000
                         + "\n/reset\n/exit\nnever sent\n")
        assert repl.returncode == 0, repl.stderr
        assert "commands: /help shows this; /reset starts" in repl.stderr
        assert "unknown command /bogus; commands:" in repl.stderr and "(conversation reset)" in repl.stderr
        # stdin is a pipe: no "> " prompts on stdout, only the one reply (to //x, 3 tokens) on its own line
        assert "> " not in repl.stdout and len(repl.stdout.splitlines()) == 1 and repl.stdout.endswith("\n"), \
            repl.stdout
        assert "[3 tokens, TTFT" in repl.stderr
        # the bound refuses 4,000 characters before tokenizing; 1,000 pass it and their count is refused
        assert "error: the prompt cannot fit the model's context of " in repl.stderr
        assert re.search(r"error: the chat is 10\d\d tokens; with --max-tokens 3 it cannot fit the context of "
                         r"256 tokens \(/reset starts over", repl.stderr), repl.stderr
        assert "(reading" not in repl.stderr  # refused before the prefill was announced
        chat = meshinfer("chat", "--peers", url, "-p", "hello", "--max-tokens", "6", "--json", env=env)
        assert chat.returncode == 0, chat.stderr
        d = json.loads(chat.stdout)
        assert d["token_ids"] == expected_tokens(tiny_gguf, "hello", 6)
        assert d["route"][0]["layers"] == "0-3" and d["route"][0]["peer_id"].startswith(m.group(1))
        assert set(d["speculative"]) >= {"proposed", "accepted", "steps"}  # on by default
        plain = meshinfer("chat", "--peers", url, "-p", "hello", "--max-tokens", "6", "--json", "--no-speculate",
                          env=env)
        assert plain.returncode == 0, plain.stderr
        assert (json.loads(plain.stdout)["token_ids"], json.loads(plain.stdout)["speculative"]) == (d["token_ids"], {})
        drafted = meshinfer("chat", "--peers", url, "-p", "hello", "--max-tokens", "6", "--json", "--draft-model",
                            str(tiny_gguf), "--draft-dtype", "f32", env=env)
        assert drafted.returncode == 0, drafted.stderr
        d2 = json.loads(drafted.stdout)
        assert (d2["token_ids"], d2["speculative"]["drafter"]) == (d["token_ids"], "model:tiny")
        long = meshinfer("chat", "--peers", url, "-p", "x" * 4000, "--max-tokens", "4", env=env)
        assert long.returncode == 2 and long.stderr.strip().splitlines()[-1].startswith(
            "error: the prompt cannot fit the model's context of "), long.stderr  # the API's 400 message
        assert "its 4000 characters are at least 308 tokens (no token of this vocabulary spells more than 13 " \
               "characters), and max_tokens is 4" in long.stderr
        bad = meshinfer("chat", "--peers", url, "-p", "hello", env=env | {"MESHINFER_SPECULATE": "maybe"})
        assert bad.returncode == 2 and "$MESHINFER_SPECULATE='maybe' is not one of" in bad.stderr
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "shutting down" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_status_require_route_fails_without_a_complete_route(tiny_gguf, tmp_path):
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf), "--layers", "0-1",
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"ready: peer \w+ serving layers 0-1 of 4 at (ws://127\.0\.0\.1:\d+)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        plain = meshinfer("status", "--peers", m.group(1), env=env)
        assert plain.returncode == 0, plain.stderr
        assert "layers 2-3 have no usable peer" in plain.stdout
        strict = meshinfer("status", "--peers", m.group(1), "--require-route", "--json", env=env)
        assert strict.returncode == 1, strict.stderr
        assert json.loads(strict.stdout)["routes"][0]["missing_layers"] == ["2-3"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_serve_starts_before_its_peers_and_answers_503_until_they_come(tiny_gguf, tmp_path):
    import urllib.error
    import urllib.request

    def models(api: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{api}/models", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    peer_url = f"ws://127.0.0.1:{free_port_base(1)}"
    procs = [subprocess.Popen([sys.executable, "-m", "meshinfer", "serve", "--peers", peer_url, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)]
    try:
        line = procs[0].stdout.readline()
        m = re.fullmatch(r"ready: OpenAI-compatible API at (http://127\.0\.0\.1:\d+/v1) \(models: none yet\)\n", line)
        assert m, line + procs[0].stderr.read() if procs[0].poll() is not None else line
        status, body = models(m.group(1))
        assert status == 503 and body["error"]["code"] == "peer_unavailable", body
        procs.append(subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf),
                                       "--listen", peer_url[len("ws://"):]], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
        assert "ready: peer" in procs[1].stdout.readline()
        status, body = models(m.group(1))  # the table is refreshed when its TTL has passed: ask until then
        for _ in range(40):
            if status == 200 and body["data"]:
                break
            time.sleep(1)
            status, body = models(m.group(1))
        assert status == 200 and body["data"][0]["meshinfer"]["complete_route"] is True, body
        procs[0].send_signal(signal.SIGTERM)
        out, err = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 0 and "answering 503 until a peer does" in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_private_mesh_needs_the_key_file(tiny_gguf, tmp_path):
    (tmp_path / "mesh.key").write_text("a shared secret of 32 characters\n")
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    env.pop("MESHINFER_MESH_KEY_FILE", None)
    proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf),
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env | {"MESHINFER_MESH_KEY_FILE": str(tmp_path / "mesh.key")})
    try:
        line = proc.stdout.readline()
        m = re.search(r"ready: peer (\w+) serving .* at (ws://127\.0\.0\.1:\d+)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        refused = meshinfer("status", "--peers", m.group(2), env=env)
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1] == (
            f"error: no bootstrap peer answered: {m.group(2)}: this mesh is private: pass its key with "
            f"--mesh-key-file (or MESHINFER_MESH_KEY_FILE)")
        status = meshinfer("status", "--peers", m.group(2), "--json", "--mesh-key-file", str(tmp_path / "mesh.key"),
                           env=env)
        assert status.returncode == 0, status.stderr
        assert [p["peer_id"] for p in json.loads(status.stdout)["peers"]] == [m.group(1)]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_join_with_a_self_signed_certificate_serves_wss(tiny_gguf, tmp_path):
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    env.pop("MESHINFER_MESH_KEY_FILE", None)
    proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf),
                             "--listen", "127.0.0.1:0", "--key", str(tmp_path / "k.pem"), "--tls", "self-signed"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"ready: peer (\w+) serving .* at (wss://127\.0\.0\.1:\d+)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        assert oct(os.stat(tmp_path / "k.pem.tls-key.pem").st_mode & 0o777) == "0o600"
        status = meshinfer("status", "--peers", m.group(2), "--json", env=env)
        assert status.returncode == 0, status.stderr
        plain = meshinfer("status", "--peers", m.group(2).replace("wss://", "ws://"), env=env)
        assert plain.returncode == 2 and plain.stderr.strip().splitlines()[-1].endswith(
            "if the peer serves TLS (join --tls), use wss://"), plain.stderr
        [peer] = json.loads(status.stdout)["peers"]
        assert peer["peer_id"].startswith(m.group(1))
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.realmodel
def test_pull_prints_path_last(tmp_path):
    """The smaller real model, already verified in the default cache, is found without downloading."""
    from helpers.realmodels import model_path

    cached = model_path("smollm2-135m-instruct-q4_1")
    env = dict(os.environ, MESHINFER_HOME=str(cached.parent.parent))
    out = meshinfer("pull", "smollm2-135m-instruct-q4_1", "-q", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(cached)


@pytest.mark.slow
def test_bench_measures_single_peer_and_split(tiny_gguf, tmp_path):
    from meshinfer.app.bench import even_splits

    assert even_splits(24, 5) == [(0, 3), (4, 8), (9, 13), (14, 18), (19, 23)]
    out = meshinfer("bench", "--model", str(tiny_gguf), "--splits", "1,2", "--max-tokens", "3", "--repeats", "3",
                    "--base-port", str(free_port_base(60)), "--out", str(tmp_path / "b.json"), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| 1 |" in out.stdout and "| 2 |" in out.stdout and "[0-1] ->" in out.stdout
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["peers"] for r in rows] == [1, 2] and all(r["decode_tokens_per_s"] > 0 for r in rows)
    one, two = (r["decode_tokens_per_s_runs"] for r in rows)
    assert len(one) == len(two) == 3 and rows[0]["vs_first"] == 1.0
    assert rows[1]["vs_first"] == statistics.median(b / a for a, b in zip(one, two))  # turn by turn
    assert f"| {rows[1]['decode_tokens_per_s']:.2f} | {rows[1]['vs_first']:.2f} |" in out.stdout


@pytest.mark.slow
def test_bench_speculative_and_ttft_suites_run(tiny_gguf, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[{"role": "user", "content": "hello"}], [{"role": "user", "content": "a haiku"}]]))
    out = meshinfer("bench", "--model", str(tiny_gguf), "--suite", "speculative,ttft", "--splits", "1,2",
                    "--rtts", "0,20", "--max-tokens", "6", "--repeats", "1", "--long-prompt-tokens", "100",
                    "--prompts", str(prompts), "--draft-model", str(tiny_gguf), "--draft-dtype", "f32",
                    "--base-port", str(free_port_base(60)), "--out", str(tmp_path / "b.json"), timeout=400)
    assert out.returncode == 0, out.stderr
    assert "| RTT ms | prompts | mode | tok/s | vs plain |" in out.stdout and "| peers | join to ready s |" in out.stdout
    result = json.loads((tmp_path / "b.json").read_text())
    spec, ttft = result["speculative"], result["ttft"]
    assert [(r["rtt_ms"], r["prompts"], r["mode"]) for r in spec] == [
        (rtt, p, m) for rtt in (0, 20) for p in ("general", "code edit") for m in ("plain", "lookup", "draft")]
    assert all(r["identical"] and r["tokens_per_s"] > 0 and r["ttft_ms_median"] > 0 for r in spec)
    assert "| steps (verify) | TTFT ms | identical |" in out.stdout
    assert [r["conversations"] for r in spec[:3]] == [2, 2, 2]
    bad_prompts = meshinfer("bench", "--model", str(tiny_gguf), "--suite", "speculative", "--prompts", str(tiny_gguf))
    assert bad_prompts.returncode == 2 and f"--prompts {tiny_gguf}:" in bad_prompts.stderr
    assert [r["peers"] for r in ttft] == [1, 2]
    assert all(r["long_prompt_tokens"] == 100 and r["long_ttft_ms"] > 0 and r["cold_ttft_ms"] > 0
               and r["join_to_ready_s"] > 0 for r in ttft)
    bad = meshinfer("bench", "--model", str(tiny_gguf), "--suite", "fastest")
    assert bad.returncode == 2 and "--suite 'fastest': choose from splits, speculative, ttft" in bad.stderr


@pytest.mark.slow
def test_bench_concurrency_reports_aggregate_tokens_per_s(tiny_gguf, tmp_path):
    out = meshinfer("bench", "--model", str(tiny_gguf), "--splits", "1,2", "--concurrency", "1,3", "--max-tokens", "6",
                    "--base-port", str(free_port_base(60)), "--out", str(tmp_path / "c.json"), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| peers | conversations | aggregate decode tok/s |" in out.stdout and "| 2 | 3 |" in out.stdout
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [(r["peers"], r["conversations"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert [r["tokens"] for r in rows] == [7, 21, 7, 21]  # the first token, then 6 decoded each
    assert all(r["end_to_end_tokens_per_s"] > 0 and r["aggregate_tokens_per_s"] > 0 for r in rows)


def test_chat_says_when_it_reads_a_long_prompt(capsys):
    from types import SimpleNamespace

    from meshinfer.app.cli import LONG_PROMPT_TOKENS, _announce_prefill

    route, text = SimpleNamespace(hops=[1, 2]), SimpleNamespace(json=False)
    prompt = list(range(LONG_PROMPT_TOKENS + 10))
    _announce_prefill(len(prompt), route, text)
    assert capsys.readouterr().err == (f"(reading {LONG_PROMPT_TOKENS + 10} prompt tokens through 2 hop(s) "
                                       f"before the first token)\n")
    _announce_prefill(len(prompt) - 20, route, text)  # the hops hold 20: fewer new tokens than the limit
    _announce_prefill(len(prompt), route, SimpleNamespace(json=True))  # --json prints only the JSON
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("system, turns", [(None, []), ("", [{"role": "system", "content": ""}]),
                                           ("be brief", [{"role": "system", "content": "be brief"}])])
def test_an_explicit_empty_system_message_is_kept(system, turns):
    """``--system ""`` is a system turn (the template's default system prompt is left out, as
    with an empty one in --messages); no --system adds none."""
    from argparse import Namespace

    from meshinfer.app.cli import _messages

    args = Namespace(messages=None, system=system, prompt="hi")
    assert _messages(args) == turns + [{"role": "user", "content": "hi"}]


@pytest.mark.slow
def test_three_peers_joined_without_layer_ranges_cover_the_model_and_a_route_exists(tiny_gguf, tmp_path):
    """Three peers started one after another with no layer range (``--max-layers 2`` of the tiny
    model's 4): the first, with no mesh, takes what fits; the others take the least-served
    window. Each says what it took; the mesh ends covered and a chat is answered through it."""
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    procs = []
    try:
        def join(*extra: str) -> list[str]:
            log = tmp_path / f"join{len(procs)}.log"
            proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf),
                                     "--listen", "127.0.0.1:0", "--key", str(tmp_path / f"k{len(procs)}.pem"),
                                     "--max-layers", "2", *extra], stdout=subprocess.PIPE, stderr=log.open("w"),
                                    text=True, env=env)
            procs.append(proc)
            lines = [proc.stdout.readline()]
            while lines[-1] and not lines[-1].startswith("ready:"):
                lines.append(proc.stdout.readline())
            assert lines[-1].startswith("ready:"), "".join(lines) + log.read_text()
            return lines

        def coverage(url: str, want: str) -> str:
            deadline = time.monotonic() + 60  # a new peer's advert reaches the first within a gossip round
            status = meshinfer("status", "--peers", url, env=env)
            while want not in status.stdout and time.monotonic() < deadline:
                time.sleep(0.5)
                status = meshinfer("status", "--peers", url, env=env)
            return status.stdout

        first = join("--layers", "auto")  # no mesh to ask: a first peer
        assert first[0].startswith("taking layers 0-1 of 4"), first
        url = re.search(r"at (ws://127\.0\.0\.1:\d+)", first[-1]).group(1)
        second = join("--peers", url)  # no --layers: auto, since a mesh is named
        assert second[0].strip() == ("taking layers 2-3 of 4: 2 of its layers have no peer (mesh coverage 11..), "
                                     "at most 2 layers fit"), second
        assert "|1111|" in coverage(url, "|1111|")
        third = join("--peers", url)
        assert third[0].startswith("taking layers "), third
        took = re.match(r"taking layers (\d)-(\d) of 4", third[0]).groups()
        want = "|2211|" if took == ("0", "1") else "|1122|" if took == ("2", "3") else None
        assert want is not None and want in coverage(url, want), third
        chat = meshinfer("chat", "--peers", url, "-p", "hello", "--max-tokens", "4", "--json", env=env)
        assert chat.returncode == 0, chat.stderr
        assert len(json.loads(chat.stdout)["route"]) >= 2  # no peer holds every layer
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_join_layers_auto_takes_the_gap_and_status_shows_coverage(tiny_gguf, tmp_path):
    """A peer of layers 0-1 is up; ``join --layers auto --max-layers 2`` takes 2-3 and says why;
    then status shows every layer covered once."""
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))
    procs = []
    try:
        def join(*extra: str) -> tuple[subprocess.Popen, list[str]]:
            log = tmp_path / f"join{len(procs)}.log"  # a file, not a pipe nobody reads: logs never block it
            proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(tiny_gguf),
                                     "--listen", "127.0.0.1:0", "--key", str(tmp_path / f"k{len(procs)}.pem"),
                                     *extra], stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
            procs.append(proc)
            lines = [proc.stdout.readline()]
            while lines[-1] and not lines[-1].startswith("ready:"):
                lines.append(proc.stdout.readline())
            assert lines[-1].startswith("ready:"), "".join(lines) + log.read_text()
            return proc, lines

        _, first = join("--layers", "0-1")
        url = re.search(r"at (ws://127\.0\.0\.1:\d+)", first[-1]).group(1)
        _, second = join("--layers", "auto", "--max-layers", "2", "--peers", url)
        assert second[0].strip() == ("taking layers 2-3 of 4: 2 of its layers have no peer (mesh coverage 11..), "
                                     "at most 2 layers fit")
        assert "serving layers 2-3 of 4" in second[-1]
        deadline = time.monotonic() + 60  # the second peer's advert reaches the first within a gossip round
        status = meshinfer("status", "--peers", url, env=env)
        while "|1111|" not in status.stdout and time.monotonic() < deadline:
            time.sleep(0.5)
            status = meshinfer("status", "--peers", url, env=env)
        assert "  coverage layers 0-3 |1111| (peers per layer; . = none)" in status.stdout, status.stdout
        data = json.loads(meshinfer("status", "--peers", url, "--json", env=env).stdout)
        assert data["routes"][0]["coverage"] == [1, 1, 1, 1]
        bad = meshinfer("join", "--model", str(tiny_gguf), "--layers", "0-1", "--max-layers", "2", env=env)
        assert bad.returncode == 2 and "--max-layers goes with --layers auto" in bad.stderr
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def no_torch(monkeypatch):
    """Importing torch, the peer, the client or the engine (its torch-free model registry aside)
    raises ImportError: what ``join`` may not load while it checks its arguments. Modules already
    imported by this process do not run again, so a subprocess test checks the real import chain."""
    importlib.import_module("meshinfer.app.cli")  # loaded before the guard: the module itself is torch-free

    real = builtins.__import__

    def guarded(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name != "meshinfer.engine.weights.registry" and (
                name == "torch" or name.startswith(("torch.", "meshinfer.peer", "meshinfer.client", "meshinfer.engine"))):
            raise ImportError(f"{name} was imported while checking join's arguments")
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", guarded)


def join_args(tiny_gguf, *extra: str):
    from meshinfer.app.cli import build_parser

    return build_parser().parse_args(["join", "--model", str(tiny_gguf), "--listen", "127.0.0.1:0", *extra])


@pytest.mark.parametrize("extra,message", [
    (["--layers", "5-2"], "layer range '5-2' is empty: last layer 2 < first layer 5"),
    (["--layers", "0-99"], "layer range 0-99 is outside the model: it has 4 layers (0-3)"),  # from the header
    (["--layers", "zero-3"], "layer range 'zero-3' is not of the form FIRST-LAST, e.g. 0-11"),
    (["--peers", "10.0.0.5:7700"], "peer address '10.0.0.5:7700' is not ws://HOST:PORT or wss://HOST:PORT"),
    (["--peers", "ws://10.0.0.5:70000"], "peer address 'ws://10.0.0.5:70000' has no host or a port outside 1-65535"),
    (["--public-addr", "wss://:7700"], "peer address 'wss://:7700' has no host or a port outside 1-65535"),
    (["--listen", "127.0.0.1:70000"], "--listen '127.0.0.1:70000' is not HOST:PORT with a port 0-65535"),
    (["--metrics-port", "70000"], "--metrics-port 70000 is not a TCP port (0 turns metrics off)"),
    (["--listen", "none"], "--listen none needs --peers"),
    (["--listen", "none", "--peers", "ws://127.0.0.1:1", "--public-addr", "ws://h:1"],
     "--listen none and --public-addr contradict each other"),
    (["--layers", "0-1", "--max-layers", "2"], "--max-layers goes with --layers auto"),
    (["--layers", "auto", "--max-layers", "0"], "--max-layers must be at least 1, got 0"),
    (["--tls-cert", "peer.crt"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent/peer.crt", "--tls-key", "/nonexistent/peer.key"],
     "cannot load TLS certificate /nonexistent/peer.crt with key /nonexistent/peer.key"),
    (["--max-batch", "0"], "--max-batch must be at least 1 (1 turns batching off), got 0"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--idle-timeout", "0"], "--idle-timeout must be above 0 seconds, got 0.0"),
    (["--kv-budget", "lots"], "'lots' is not a size such as 2GiB or 512MB"),
    (["--model", "/nonexistent/model.gguf"], "model '/nonexistent/model.gguf' is not a known model name"),
    (["--dtype", "gguf-a8", "--device", "cuda"], "precision gguf-a8 uses CPU kernels; use f32/bf16/f16 on cuda"),
    (["--dtype", "gguf-a8", "--device", "foo"], "device 'foo' is not one of cpu, cuda, cuda:N, mps"),
])
def test_join_checks_its_arguments_before_torch_loads(tiny_gguf, no_torch, extra, message):
    from meshinfer.app.cli import check_join_args
    from meshinfer.core.errors import MeshError

    with pytest.raises((ValueError, MeshError)) as info:  # what main() prints as one error: line, exit 2
        check_join_args(join_args(tiny_gguf, *extra))
    assert message in str(info.value)


def test_join_arguments_that_pass_the_checks_give_the_plan(tiny_gguf, no_torch):
    from meshinfer.app.cli import check_join_args
    from meshinfer.core.config import LayerRange

    plan = check_join_args(join_args(tiny_gguf, "--layers", "1-3", "--kv-budget", "1MiB"))
    assert (plan.layers, plan.auto, plan.port, plan.kv_budget_bytes) == (LayerRange(1, 4), False, 0, 1 << 20)
    plan = check_join_args(join_args(tiny_gguf, "--peers", "ws://127.0.0.1:1", "--max-layers", "2"))
    assert (plan.layers, plan.auto, plan.bootstrap) == (None, True, ("ws://127.0.0.1:1",))


@pytest.mark.parametrize("extra,message", [
    (["--messages", "/nonexistent/chat.json"], "error: --messages /nonexistent/chat.json: [Errno 2] No such file"),
    (["-p", "hi", "--model", "/nonexistent/model.gguf"], "error: model '/nonexistent/model.gguf' is not a known"),
    (["-p", "hi", "--threads", "0"], "error: --threads must be at least 1, got 0"),
    (["-p", "hi", "--dtype", "q8-bf16", "--device", "mps"], "error: precision q8-bf16 uses CPU kernels"),
    (["-p", "hi", "--device", "gpu"], "error: device 'gpu' is not one of cpu, cuda, cuda:N, mps"),
])
def test_generate_checks_its_arguments_before_torch_loads(tiny_gguf, no_torch, capsys, monkeypatch, extra, message):
    from meshinfer.app import cli

    monkeypatch.setattr(cli, "_setup_logging", lambda *a: None)  # leave this process's logging alone
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))  # main leaves it and the spin alone
    assert cli.main(["generate", "--model", str(tiny_gguf), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.splitlines()) == 1, err


def _unset_openmp_env(monkeypatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.setenv(name, "x")  # recorded, so whatever main sets is undone after the test
        monkeypatch.delenv(name)


def test_commands_that_compute_choose_a_short_openmp_spin(tiny_gguf, no_torch, monkeypatch):
    """generate (as join, bench and a draft model) sets the OpenMP wait policy before torch
    loads: sleep, after a spin of OPENMP_SPIN_COUNT polls for libgomp; a command that computes
    nothing leaves the environment alone."""
    from meshinfer.app import cli

    monkeypatch.setattr(cli, "_setup_logging", lambda *a: None)
    _unset_openmp_env(monkeypatch)
    assert cli.main(["generate", "--model", str(tiny_gguf), "-p", "hi", "--threads", "0"]) == 2
    policy = "PASSIVE" if sys.platform == "darwin" else "ACTIVE"
    assert (os.environ["OMP_WAIT_POLICY"], os.environ["GOMP_SPINCOUNT"]) == (policy, cli.OPENMP_SPIN_COUNT)
    assert os.environ["KMP_BLOCKTIME"] == "0"
    _unset_openmp_env(monkeypatch)
    assert cli.main(["pull", "no-such-model"]) == 2
    assert not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"} & set(os.environ)


@pytest.mark.parametrize("preset", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"},
                                    {"GOMP_SPINCOUNT": "0"}, {"GOMP_SPINCOUNT": "300000"}, {"KMP_BLOCKTIME": "200"}])
def test_a_users_openmp_wait_choice_is_kept_whole(preset):
    """With the policy, the spin count or libomp's block time set by the user,
    openmp_wait_policy adds nothing: a spin count next to OMP_WAIT_POLICY=ACTIVE would override
    it in libgomp."""
    from meshinfer.app.cli import openmp_wait_policy

    env = dict(preset)
    openmp_wait_policy(env)
    assert env == preset


def test_the_openmp_policy_spins_briefly_under_each_runtime():
    """libgomp: ACTIVE (so that its throttled spin, once a process holds more OpenMP threads than
    CPUs, is 1,000 polls and not 100) capped by GOMP_SPINCOUNT; libomp, for which ACTIVE means
    spinning for ever: KMP_BLOCKTIME=0, and PASSIVE on macOS, whose torch bundles it."""
    from meshinfer.app.cli import openmp_wait_policy

    linux: dict[str, str] = {}
    openmp_wait_policy(linux, platform="linux")
    assert linux == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}
    mac: dict[str, str] = {}
    openmp_wait_policy(mac, platform="darwin")
    assert mac == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}


@pytest.mark.slow
def test_join_fails_fast_without_torch(tiny_gguf, tmp_path):
    """The whole command, in a process where importing torch fails: every argument error comes
    first, as one ``error:`` line with exit status 2."""
    poison = tmp_path / "torch"
    poison.mkdir()
    (poison / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    for extra, message in ((["--layers", "5-2"], "error: layer range '5-2' is empty: last layer 2 < first layer 5"),
                           (["--layers", "0-99"], "error: layer range 0-99 is outside the model: it has 4 layers")):
        started = time.monotonic()
        out = meshinfer("join", "--model", str(tiny_gguf), "--listen", "127.0.0.1:0", *extra, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines() == [out.stderr.splitlines()[0]] and out.stderr.startswith(message), out.stderr
        assert time.monotonic() - started < 30  # no model load (seconds); generous for a loaded machine


@pytest.mark.parametrize("tty", [True, False])
def test_the_chat_prompt_is_shown_only_to_a_terminal(monkeypatch, capsys, tty):
    from meshinfer.app.cli import _show_prompt

    class Stdin(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr(sys, "stdin", Stdin("hi\n"))
    _show_prompt()
    assert capsys.readouterr() == ("> " if tty else "", "")


@pytest.mark.parametrize("command", ["generate", "join", "bench"])
def test_a_removed_precision_is_refused_with_the_choices(command, capsys):
    """q4-gG-bf16 was removed on 2026-12-02 (gguf-a16 beat it on speed and fidelity): --dtype
    q4-g32-bf16 is an argparse error that lists what remains."""
    from meshinfer.app.cli import build_parser
    from meshinfer.core.config import PRECISION_NAMES

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--model", "m", "--dtype", "q4-g32-bf16"])
    assert exit_.value.code == 2
    choices = ", ".join(f"'{n}'" for n in PRECISION_NAMES)
    assert f"argument --dtype: invalid choice: 'q4-g32-bf16' (choose from {choices})" in capsys.readouterr().err
    assert "gguf-a16" in PRECISION_NAMES and not any(n.startswith("q4-") for n in PRECISION_NAMES)


@pytest.mark.parametrize("value,message", [("0", "must be 1-256, got 0"), ("-1", "must be 1-256, got -1"),
                                           ("100000", "must be 1-256, got 100000"),
                                           ("abc", "'abc' is not a whole number of threads")])
@pytest.mark.parametrize("command", ["chat", "serve", "bench"])
def test_draft_threads_out_of_range_are_refused_by_the_parser(command, value, message, capsys):
    """--draft-threads 0 was taken as the default, -1 ended in a traceback from torch's thread
    pool and 100000 in a segmentation fault (a new user's check): now one argparse error."""
    from meshinfer.app.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--draft-threads", value])
    assert exit_.value.code == 2
    assert f"argument --draft-threads: {message}" in capsys.readouterr().err


def test_the_stats_line_says_why_a_draft_model_drafted_nothing():
    """A new user saw `drafts 0/0` from a loaded draft model and took it as broken: the line now
    says the policy found no gain; with drafts it gives the count as before."""
    from types import SimpleNamespace

    from meshinfer.app.cli import _stats_line

    def result(proposed: int, accepted: int, drafter: str):
        return SimpleNamespace(token_ids=[1, 2, 3], decode_tokens_per_s=5.0, ttft_ms=100.0, finish_reason="stop",
                               speculative={"proposed": proposed, "accepted": accepted, "drafter": drafter})
    idle = _stats_line(result(0, 0, "model:qwen"))
    assert "drafts 0/0 accepted (qwen): drafting measured no gain on this route" in idle
    busy = _stats_line(result(32, 31, "model:qwen"))
    assert "drafts 31/32 accepted (qwen)," in busy and "no gain" not in busy
    assert "drafts" not in _stats_line(result(0, 0, "prompt-lookup"))


def test_the_stats_line_ends_with_the_unverified_notes_after_the_finish_reason():
    """A new user read ``finish: stop`` as part of the last UNVERIFIED note: the finish reason
    comes first, then each note after a semicolon."""
    from types import SimpleNamespace

    from meshinfer.app.cli import _stats_line

    r = SimpleNamespace(token_ids=[1, 2], decode_tokens_per_s=5.0, ttft_ms=100.0, finish_reason="stop",
                        unverified=[{"peer": "a" * 64, "layers": "0-11", "reason": "nobody checked"},
                                    {"peer": "b" * 64, "layers": "12-23", "reason": "nobody checked"}])
    line = _stats_line(r)
    assert line.startswith("[2 tokens, TTFT 100 ms, 5.0 tok/s, finish: stop; UNVERIFIED: peer aaaaaaaaaaaa (layers 0-11)")
    assert line.endswith("; UNVERIFIED: peer bbbbbbbbbbbb (layers 12-23): nobody checked]")


class _RacingClient:
    """A client whose ``plan`` learns, in its own refresh, a faster peer at another precision
    (a hostile advert timed for the second fetch of the table), and a table of hostile precision
    strings: what ``plan_for`` sees when an attacker races ``chat --precision``."""

    def __init__(self, junk: int = 0) -> None:
        from types import SimpleNamespace as NS

        self.ns = NS
        self.table = {"slow": NS(weights_hash="w", precision="gguf-a16")}
        self.table.update({f"junk{i}": NS(weights_hash="w", precision="\x1b]0;owned\x07" + "x" * 4000 + str(i))
                           for i in range(junk)})

    async def refresh(self) -> None:
        pass

    async def plan(self, *, exclude=frozenset()):
        from meshinfer.core.errors import NoRoute

        self.table["fast"] = self.ns(weights_hash="w", precision="f32")  # learnt by plan's own refresh
        usable = [pid for pid in ("fast", "slow") if pid not in exclude and pid in self.table]
        if not usable or any(pid.startswith("junk") for pid in self.table if pid not in exclude):
            raise NoRoute("no compatible chain")
        return self.ns(compat_key=("w", self.table[usable[0]].precision), hops=[usable[0]])

    async def tokenizer(self, route):
        return "tokenizer"


def test_a_peer_learnt_while_planning_cannot_take_a_route_of_another_precision():
    """``chat --precision gguf-a16``: peers of other precisions were excluded from the table as
    fetched before ``plan``, whose own refresh then learnt a faster f32 peer; it got the route.
    And a NoRoute listed every precision string of the table (hostile: terminal escapes, 4,000
    characters each): only known precision names are listed now."""
    import asyncio

    from meshinfer.app.reply import plan_for
    from meshinfer.core.errors import NoRoute

    route, tok = asyncio.run(plan_for(_RacingClient(), precision="gguf-a16"))
    assert route.compat_key[1] == "gguf-a16" and route.hops == ["slow"] and tok == "tokenizer"
    with pytest.raises(NoRoute) as err:
        asyncio.run(plan_for(_RacingClient(junk=50), precision="bf16"))
    message = str(err.value)
    assert message.endswith("asked for precision bf16, the mesh's peers compute at f32, gguf-a16 "
                            "and 50 other precision name(s)"), message[-300:]
    assert "\x1b" not in message and len(message) < 400


async def test_status_and_chat_do_not_route_through_a_peer_the_client_cannot_reach(tiny, capsys):
    """Found by a new-user run: with a peer killed (its advert still in the table until it
    expires), `status --require-route` printed a complete route through it and exited 0 while
    `chat` said only "layers 2-3 have no ready peer". Status now plans as chat does, over the
    peers it reached, and chat's error says which ready peer it could not reach and why."""
    import asyncio

    from helpers.hostile import serving
    from helpers.meshkit import crash
    from meshinfer.app import cli
    from meshinfer.client.mesh import MeshClient
    from meshinfer.core.errors import NoRoute

    async with serving(tiny, (0, 2, 4)) as peers:
        await crash(peers[1])
        assert peers[0].table.get(peers[1].peer_id) is not None  # not expired yet
        code = await asyncio.to_thread(cli.main, ["status", "--peers", peers[0].addrs[0], "--require-route"])
        out = capsys.readouterr().out
        assert code == 1, out
        assert "no complete route" in out and "unreachable" in out and "layers 2-3 have no usable peer" in out
        async with MeshClient(list(peers[0].addrs)) as client:
            with pytest.raises(NoRoute, match=f"peer {peers[1].peer_id[:12]} \\(layers 2-3\\) is ready but "
                                              f"unreachable from this client: cannot reach"):
                await client.plan()


def test_the_first_errors_a_new_user_meets_say_what_to_do():
    from types import SimpleNamespace

    from meshinfer.app import cli
    from meshinfer.core.errors import NoRoute, PeerUnavailable

    default, given = SimpleNamespace(peers=cli.DEFAULT_PEERS), SimpleNamespace(peers="ws://127.0.0.1:9")
    refused = PeerUnavailable("no bootstrap peer answered: cannot reach ws://127.0.0.1:7700: [Errno 111]")
    assert "no --peers given" in cli._hint(default, refused) and "meshinfer join" in cli._hint(default, refused)
    assert cli._hint(given, refused) == ""
    assert "meshinfer join --layers" in cli._hint(given, NoRoute("no route: layers 2-3 have no ready peer"))
    assert cli._hint(given, NoRoute("no route: layers 2-3 have no ready peer; peer ab is ready but unreachable")) == ""


def test_every_name_that_means_this_machine_is_loopback_for_plain_ws():
    """A new-user run: `localhost` passed, but the other names the scopes call loopback did not."""
    from meshinfer.wire.tls import is_loopback

    for host in ("localhost", "LOCALHOST", "localhost.", "localhost.localdomain", "ip6-localhost", "a.localhost",
                 "127.0.0.2", "[::1]", "[::ffff:127.0.0.1]", "0x7f.1", "2130706433"):
        assert is_loopback(host), host
    for host in ("example.com", "10.0.0.1", "localhostx", "vm", "0.0.0.0", "::", "[::]"):  # 0.0.0.0: every interface
        assert not is_loopback(host), host


async def test_chat_model_picks_one_of_several_models_in_the_mesh(tmp_path):
    """A new-user run: with two models in one mesh, `chat` took the fastest and nothing let the
    user choose. `--model` takes a known name or the start of a weights hash."""
    from helpers.meshkit import file_hash, start_peer, wait_for_tables
    from meshinfer.app import reply
    from meshinfer.client.mesh import MeshClient

    cfg = tiny_config("qwen2", context=128)
    paths = [write_gguf(tmp_path / f"m{i}.gguf", cfg, random_weights(cfg, seed=40 + i)) for i in range(2)]
    hashes = [file_hash(p) for p in paths]
    first = await start_peer(load_shard(paths[0]), weights_hash=hashes[0],
                             bundle=Tokenizer.from_gguf(paths[0]).to_bundle())
    second = await start_peer(load_shard(paths[1]), weights_hash=hashes[1],
                              bundle=Tokenizer.from_gguf(paths[1]).to_bundle(), bootstrap=first.addrs)
    try:
        await wait_for_tables([first, second])
        async with MeshClient(list(first.addrs)) as client:
            for h in hashes:
                for name in (h[:8], h[:20].upper(), reply.model_id(h)):
                    assert await reply.weights_for(client, name) == h, name
                route, _ = await reply.plan_for(client, weights_hash=await reply.weights_for(client, h[:10]))
                assert route.compat_key[0] == h and route.peer_ids == ((first if h == hashes[0] else second).peer_id,)
            with pytest.raises(ValueError, match=f"no model this mesh serves \\(it serves .*sha256-{hashes[0][:16]}"):
                await reply.weights_for(client, "qwen-not-here")
            with pytest.raises(ValueError, match="no model this mesh serves"):
                await reply.weights_for(client, hashes[0][:7])  # too short to name weights
    finally:
        await second.close()
        await first.close()


def test_a_json_chat_that_fails_prints_its_error_as_json_too(capsys):
    """A new-user run: `chat --json` printed errors on stderr only, nothing on stdout."""
    from meshinfer.app import cli

    assert cli.main(["chat", "-p", "x", "--peers", "ws://127.0.0.1:1", "--json"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: no bootstrap peer answered")
    error = json.loads(out)["error"]
    assert error["code"] == "peer_unavailable" and error["message"].startswith("no bootstrap peer answered")
