"""A peer's weights are its own copy of the model file's tensors at every precision
(``GGUFFile.iter_shard_tensors``): the file written over in place under a running peer changes
none of its answers. (Truncated: ``tests/test_cli.py``, in a subprocess, since a regression
there is a SIGBUS.) Loading one costs no memory beyond its weights that an import could save."""

from __future__ import annotations

import gguf
import pytest

from helpers.meshkit import generate_through
from helpers.tiny import random_weights, tiny_config, write_gguf
from meshinfer.peer.launch import launch_peer
from meshinfer.peer.node import PeerSettings
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.wire import protocol

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize("dtype", ["gguf", "gguf-a16", "f32"])
async def test_a_peer_answers_the_same_after_its_model_file_is_written_over(tmp_path, dtype):
    model = tmp_path / "model.gguf"
    cfg = tiny_config("qwen2", context=256)
    write_gguf(model, cfg, random_weights(cfg, seed=7),
               quantize=lambda name: gguf.GGMLQuantizationType.Q8_0 if name.endswith("proj.weight") else None)
    tok = Tokenizer.from_gguf(model)
    peer = await launch_peer(str(model), None, dtype=dtype, settings=PeerSettings(gossip_interval_s=0.1),
                             key_path=str(tmp_path / "k.pem"), home=str(tmp_path), warmup=False)
    try:
        _, _, before = await generate_through([peer], tok, MESSAGES, max_tokens=6)
        size = model.stat().st_size
        with open(model, "r+b") as f:  # the same inode: what a `cp` over the file does
            f.seek(4096)
            f.write(bytes(size - 4096))
        _, _, after = await generate_through([peer], tok, MESSAGES, max_tokens=6)
        assert after.token_ids == before.token_ids and len(before.token_ids) == 6
        assert peer.state == protocol.READY
    finally:
        await peer.close()


async def test_a_model_file_changed_while_a_peer_loads_it_is_refused(tmp_path, monkeypatch):
    """The weights hash is taken before the copy and checked after it: a peer never advertises
    the hash of bytes other than those it loaded."""
    from meshinfer.core.errors import WeightsError
    from meshinfer.engine import generate

    model = tmp_path / "model.gguf"
    cfg = tiny_config("qwen2", context=256)
    write_gguf(model, cfg, random_weights(cfg, seed=7))
    real = generate.load_shard

    def load_then_change(*args, **kwargs):
        shard = real(*args, **kwargs)
        with open(model, "ab") as f:
            f.write(b"\0" * 64)
        return shard

    monkeypatch.setattr(generate, "load_shard", load_then_change)
    with pytest.raises(WeightsError, match="the model file changed while this peer loaded it"):
        await launch_peer(str(model), None, dtype="f32", key_path=str(tmp_path / "k.pem"), home=str(tmp_path),
                          warmup=False)


@pytest.mark.parametrize("blocks", [True, False], ids=["gguf_blocks", "dequantized"])
def test_a_model_file_cut_short_during_a_load_is_a_clear_error(tmp_path, blocks):
    """Tensors are read with os.pread, not through the file's memory map: a file truncated
    after it was opened (the header read, the tensors not yet) gives a WeightsError naming the
    tensor, not SIGBUS on a mapped page past the new end (found by an attack run)."""
    from meshinfer.core.config import LayerRange
    from meshinfer.core.errors import WeightsError
    from meshinfer.engine.weights.gguf_file import GGUFFile

    model = tmp_path / "model.gguf"
    cfg = tiny_config("qwen2", context=256)
    write_gguf(model, cfg, random_weights(cfg, seed=7),
               quantize=lambda name: gguf.GGMLQuantizationType.Q8_0 if name.endswith("proj.weight") else None)
    src = GGUFFile(model)
    with open(model, "r+b") as f:
        f.truncate(model.stat().st_size // 2)
    with pytest.raises(WeightsError, match="it was changed while being read"):
        list(src.iter_shard_tensors(LayerRange(0, cfg.num_hidden_layers), blocks=blocks))


def test_loading_a_shard_does_not_import_torchs_compiler(tmp_path):
    """nn.Embedding's random init on the meta device went through torch._refs, which imports
    torch._dynamo: 40-50 MiB of every peer's memory (the default model's whole-model gguf-a8
    load peaked at 796 MiB with it, 724 without). The shard is built without that init."""
    import subprocess
    import sys

    from helpers.tiny import write_quantized_tiny

    path = write_quantized_tiny(tmp_path / "tiny.gguf", "qwen2")
    code = ("import sys, torch\n"
            "from meshinfer.engine.generate import load_shard\n"
            f"for dtype in ('f32', 'gguf-a8', 'q8-bf16'):\n"
            f"    shard = load_shard({str(path)!r}, dtype=dtype)\n"
            "    shard(torch.tensor([[1, 2, 3]]), 0)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
