"""The deploy recipes agree with the code: compose file, systemd unit, Dockerfile, local-mesh script.

No container engine runs here; these checks parse the files and feed every ``meshinfer`` command
they hold to the real CLI parser (``meshinfer.app.cli.build_parser``).
"""

from __future__ import annotations

import configparser
import contextlib
import io
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from meshinfer.app.cli import _listen, build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def parse_cli(argv: list[str], where: str):
    """``argv`` (without the program name) parsed by meshinfer's own parser; fails with argparse's error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `meshinfer {shlex.join(argv)}` is refused by the CLI parser: "
                    f"{err.getvalue().strip().splitlines()[-1]}")


def as_list(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    return yaml.safe_load(args)  # a JSON array is YAML


# --------------------------------------------------------------------------- docker-compose.yml
def test_compose_has_two_peers_and_the_api_built_from_the_dockerfile(compose):
    services = compose["services"]
    assert set(services) == {"peer-a", "peer-b", "api"}
    for name, svc in services.items():
        assert svc["image"] == "meshinfer:local", name
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    commands = {name: as_list(svc["command"])[0] for name, svc in services.items()}
    assert commands == {"peer-a": "join", "peer-b": "join", "api": "serve"}


@pytest.mark.parametrize("service", ["peer-a", "peer-b", "api"])
def test_compose_commands_are_accepted_by_the_cli_parser(compose, service):
    # the api service runs `meshinfer serve`; its flags must parse like any other command
    parse_cli(as_list(compose["services"][service]["command"]), f"docker-compose.yml service {service}")


def test_compose_ports_are_consistent_between_services(compose):
    services = compose["services"]
    published = {name: {int(p.split(":")[-1]) for p in svc.get("ports", [])} for name, svc in services.items()}
    listens = {}
    for name in ("peer-a", "peer-b"):
        args = parse_cli(as_list(services[name]["command"]), name)
        host, port = _listen(args.listen)
        listens[name] = port
        assert host == "0.0.0.0", f"{name} must listen on all interfaces of its container"
        assert {port, args.metrics_port} == published[name], f"{name} publishes {published[name]}"
        public = urlsplit(args.public_addr)
        assert (public.hostname, public.port) == (name, port), f"{name}: --public-addr {args.public_addr}"
        assert args.tls == "self-signed" and not args.insecure
    assert len({*published["peer-a"], *published["peer-b"], *published["api"]}) == 5, "host ports collide"
    # every peer URL a service dials names a peer service and the port that service listens on
    bootstrap = parse_cli(as_list(services["peer-b"]["command"]), "peer-b").peers
    api = as_list(services["api"]["command"])
    urls = [bootstrap, api[api.index("--peers") + 1]]
    for url in urls:
        u = urlsplit(url)
        assert u.scheme == "wss" and u.hostname in listens and u.port == listens[u.hostname], url
    assert int(api[api.index("--port") + 1]) in published["api"]
    assert set(services["api"]["depends_on"]) == {"peer-a", "peer-b"}


def test_compose_healthchecks_probe_the_service_own_port(compose):
    for name, svc in compose["services"].items():
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", name
        assert {"interval", "timeout", "retries", "start_period"} <= set(svc["healthcheck"]), name
        if test[1] == "meshinfer":
            args = parse_cli(test[2:], f"{name} healthcheck")
            port = _listen(parse_cli(as_list(svc["command"]), name).listen)[1]
            assert args.command == "status" and urlsplit(args.peers).port == port, name
        else:
            assert test[1] == "python" and ":8000/" in test[-1], name


def test_compose_volumes_are_declared_and_hold_models_and_keys(compose):
    declared = set(compose["volumes"])
    mounts = {}
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert source in declared, f"{name} mounts undeclared volume {source}"
            mounts.setdefault(name, {})[target] = source
    for name in ("peer-a", "peer-b"):
        assert mounts[name]["/var/lib/meshinfer/models"] == "models"
        key = parse_cli(as_list(compose["services"][name]["command"]), name).key
        assert mounts[name][str(Path(key).parent)].startswith("keys-")
    assert mounts["peer-a"]["/var/lib/meshinfer/keys"] != mounts["peer-b"]["/var/lib/meshinfer/keys"]


# --------------------------------------------------------------------------- Dockerfile
def test_dockerfile_runs_as_non_root_and_its_commands_exist():
    steps = dockerfile()
    kinds = [k for k, _ in steps]
    assert steps[0][0] == "FROM" and steps[0][1].startswith("python:3.11-slim")
    assert [a for k, a in steps if k == "USER"] == ["meshinfer"]
    assert kinds.index("USER") < min(i for i, (k, a) in enumerate(steps) if k == "RUN" and "install.sh" in a)
    for kind, args in steps:
        if kind == "COPY":
            sources = [w for w in args.split() if not w.startswith("--")][:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        if kind == "RUN":
            for script in re.findall(r"deploy/[\w.-]+", args):
                assert (ROOT / script).is_file(), f"RUN {args}: {script} does not exist"
    assert exec_form(dict(steps)["ENTRYPOINT"]) == ["meshinfer"]
    cmd = parse_cli(exec_form(dict(steps)["CMD"]), "Dockerfile CMD")
    exposed = {int(p) for p in dict(steps)["EXPOSE"].split()}
    assert {_listen(cmd.listen)[1], cmd.metrics_port, 8000} <= exposed


def test_local_mesh_script_runs_the_dockerfile_commands():
    script = (DEPLOY / "local-mesh.sh").read_text()
    runs = [a for k, a in dockerfile() if k == "RUN"]
    installs = [a for a in runs if "deploy/install.sh" in a]
    pulls = [a for a in runs if re.search(r"\bmeshinfer pull\b", a)]
    assert installs and pulls
    assert re.search(r"^\s*bash deploy/install\.sh\s*$", script, re.M), "--setup must run deploy/install.sh"
    assert re.search(r"\$\(meshinfer pull \"\$MODEL\"", script), "the script must pull the model as the image does"
    assert parse_cli(["pull", "-q", "x"], "Dockerfile pull").name == "x"
    assert "MESHINFER_VENV" in (DEPLOY / "install.sh").read_text()  # the image installs into its own venv


def test_local_mesh_script_passes_its_dtype_to_every_join(monkeypatch):
    """``--dtype D`` sets ``MESHINFER_DTYPE``, which ``meshinfer join``'s ``--dtype`` defaults to."""
    script = (DEPLOY / "local-mesh.sh").read_text()
    assert re.search(r"^\s*--dtype\) export MESHINFER_DTYPE=\$2; shift ;;$", script, re.M)
    assert "--dtype D" in script.split("set -euo")[0]  # in the usage that --help prints
    monkeypatch.setenv("MESHINFER_DTYPE", "gguf-a16")
    assert parse_cli(["join", "--model", "m.gguf", "--layers", "0-11"], "local-mesh join").dtype == "gguf-a16"


# --------------------------------------------------------------------------- systemd unit
def test_systemd_unit_execstart_parses_and_restarts_on_failure():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "meshinfer-peer.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "meshinfer"
    args = parse_cli(argv[1:], "meshinfer-peer.service ExecStart")
    assert args.command == "join" and args.log_format == "json"
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert int(service["LimitNOFILE"]) >= 65536  # connections are open files; 1024 is a few idle clients
    assert service["User"] != "root" and service["EnvironmentFile"] == "/etc/meshinfer/peer.env"
    for option in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp"):
        assert service[option] in ("yes", "strict"), option
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_peer_env_example_sets_only_variables_the_cli_reads():
    cli = (ROOT / "meshinfer" / "app" / "cli.py").read_text()
    names = re.findall(r"^#?\s*(MESHINFER_\w+)=", (DEPLOY / "peer.env.example").read_text(), re.M)
    assert len(names) >= 8
    for name in names:
        assert f'"{name}"' in cli, f"peer.env.example sets {name}, which meshinfer's CLI never reads"


# --------------------------------------------------------------------------- docs/protocol.md
def protocol_doc_section(title: str) -> str:
    text = (ROOT / "docs" / "protocol.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_message_type_has_a_row_in_the_protocol_doc():
    from meshinfer.wire.protocol import MESSAGE_TYPES

    documented = set()
    for line in protocol_doc_section("Messages").splitlines():
        if line.startswith("| `"):
            documented |= set(re.findall(r"`(\w+)`", line.split("|")[1]))
    assert sorted(MESSAGE_TYPES - documented) == []
    assert sorted(documented - MESSAGE_TYPES) == []


def test_every_error_code_is_listed_in_the_protocol_doc():
    from meshinfer.core import errors

    codes = {cls.code for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.MeshError)}
    listed = set(re.findall(r"`(\w+)`", protocol_doc_section("Error codes")))
    assert sorted(codes - listed) == []


# --------------------------------------------------------------------------- docs
@pytest.mark.parametrize("doc", ["docs/quickstart.md", "docs/wan.md"])
def test_meshinfer_commands_in_deploy_docs_are_accepted_by_the_cli_parser(doc):
    text = (ROOT / doc).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().rstrip("&").strip()
            for part in line.split("&&"):
                words = shlex.split(part)
                if words[:1] == ["meshinfer"]:
                    commands.append(words[1:])
    assert commands, f"{doc} shows no meshinfer command"
    for argv in commands:
        parse_cli(argv, doc)
