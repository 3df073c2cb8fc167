"""Issue 37 part 1: a runtime adapter load is confined to --lora_roots, reads only
safetensors of a bounded size, and a bad adapter is a 400 that leaves every other adapter and
request as it was."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import struct
import time
from pathlib import Path

import pytest

from kserve_paged.lora_paths import AdapterPathError, confine
from kserve_paged_engine.lora.safe_read import read_config, read_safetensors


def _safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


# -- the path check ---------------------------------------------------------------------------

def test_confine_accepts_paths_under_a_root_and_links_that_stay_inside(tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    (root / "a").mkdir(parents=True)
    other.mkdir()
    assert confine(str(root / "a"), [str(root)]) == os.path.realpath(root / "a")
    (root / "inner-link").symlink_to(root / "a")
    assert confine(str(root / "inner-link"), [str(root)]) == os.path.realpath(root / "a")
    (tmp_path / "root-link").symlink_to(root)  # a root given through a link works too
    assert confine(str(tmp_path / "root-link" / "a"), [str(tmp_path / "root-link")])


@pytest.mark.parametrize("case", ["outside", "dotdot", "link-out", "relative", "nul", "not-str",
                                  "file", "missing", "no-roots", "prefix-sibling"])
def test_confine_refuses_everything_else(tmp_path, case):
    root, other = tmp_path / "root", tmp_path / "other"
    (root / "a").mkdir(parents=True)
    other.mkdir()
    (tmp_path / "root-sibling").mkdir()
    (root / "link-out").symlink_to(other)
    (root / "f").write_text("x")
    roots = [str(root)]
    path = {"outside": str(other), "dotdot": f"{root}/a/../../other", "link-out":
            str(root / "link-out"), "relative": "root/a", "nul": f"{root}/a\x00", "not-str": 5,
            "file": str(root / "f"), "missing": str(root / "nope"), "no-roots": str(root / "a"),
            "prefix-sibling": str(tmp_path / "root-sibling")}[case]
    with pytest.raises(AdapterPathError):
        confine(path, [] if case == "no-roots" else roots)


# -- the file readers -------------------------------------------------------------------------

def test_oversized_weights_are_refused_from_their_size_alone(tmp_path, monkeypatch):
    big = tmp_path / "adapter_model.safetensors"
    with open(big, "wb") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB by its size, nothing on disk
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="more than any adapter"):
        read_safetensors(big, 1 << 20)
    assert reads == [] and time.perf_counter() - start < 1.0


@pytest.mark.parametrize("case", ["short", "header-too-long", "header-not-json", "dtype-f64",
                                  "dtype-int", "offsets-past-end", "shape-mismatch", "pickle",
                                  "link", "fifo", "3d"])
def test_malformed_safetensors_are_refused_before_tensors_are_made(tmp_path, case):
    f = tmp_path / "adapter_model.safetensors"
    good = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    if case == "short":
        f.write_bytes(b"\x01\x02")
    elif case == "header-too-long":
        f.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "header-not-json":
        f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    elif case in ("dtype-f64", "dtype-int", "offsets-past-end", "shape-mismatch", "3d"):
        entry = {**good, **{"dtype-f64": {"dtype": "F64", "data_offsets": [0, 32]},
                            "dtype-int": {"dtype": "I64", "data_offsets": [0, 32]},
                            "offsets-past-end": {"data_offsets": [0, 1 << 30]},
                            "shape-mismatch": {"shape": [3, 3]},
                            "3d": {"shape": [1, 2, 2]}}[case]}
        _safetensors(f, {"t": entry}, b"\x00" * 32)
    elif case == "pickle":
        f.write_bytes(pickle.dumps({"w": [1.0] * 10}))
    elif case == "link":
        _safetensors(tmp_path / "real.safetensors", {"t": good}, b"\x00" * 16)
        f.symlink_to(tmp_path / "real.safetensors")
    elif case == "fifo":
        os.mkfifo(f)
    with pytest.raises(ValueError):
        read_safetensors(f, 1 << 20)


def test_a_valid_file_reads_and_the_config_reader_bounds_its_input(tmp_path):
    import torch

    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    f = _safetensors(tmp_path / "w.safetensors",
                     {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, data)
    assert read_safetensors(f, 1 << 20)["t"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    (tmp_path / "adapter_config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match="not JSON"):
        read_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text(" " * (2 << 20))
    with pytest.raises(ValueError, match="more than"):
        read_config(tmp_path)


# -- through the server, with a real engine ---------------------------------------------------

class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PICKLE_RAN",))


def _bad_adapters(root: Path, good: Path, outside: Path) -> dict[str, str]:
    """lora_path -> why it must be refused; each a folder near a good adapter."""
    cases: dict[str, str] = {}
    pkl = root / "bin-only"
    pkl.mkdir()
    shutil.copy(good / "adapter_config.json", pkl)
    (pkl / "adapter_model.bin").write_bytes(pickle.dumps(_Boom()))
    cases[str(pkl)] = "never"
    trunc = root / "truncated"
    shutil.copytree(good, trunc)
    w = trunc / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    cases[str(trunc)] = "outside the file"
    huge = root / "huge"
    shutil.copytree(good, huge)
    with open(huge / "adapter_model.safetensors", "r+b") as f:
        f.truncate(8 << 30)
    cases[str(huge)] = "more than any adapter"
    weights_link = root / "weights-link"
    weights_link.mkdir()
    shutil.copy(good / "adapter_config.json", weights_link)
    (weights_link / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    cases[str(weights_link)] = "symbolic links"
    (root / "dir-link").symlink_to(outside)
    cases[str(root / "dir-link")] = "outside the adapter roots"
    cases[str(outside)] = "outside the adapter roots"
    cases[f"{root}/../{outside.name}"] = "outside the adapter roots"
    cases["relative/path"] = "absolute"
    return cases


@pytest.mark.slow
def test_bad_adapters_are_400s_and_leave_adapters_and_requests_untouched(tmp_path, monkeypatch):
    """Long because it builds a tiny base, two adapters and nine bad folders, then checks the
    served text of the base and a loaded adapter before, during and after the bad loads."""
    from tests.helpers.lora import make_adapter, tiny_base
    from tests.helpers.lora_server import build_lora_app, complete

    monkeypatch.chdir(tmp_path)
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    tiny_base(tmp_path / "base")
    make_adapter(tmp_path / "base", root / "a1", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj"])
    make_adapter(tmp_path / "base", outside, seed=2, r=4, lora_alpha=8,
                 target_modules=["o_proj"])
    shutil.copytree(outside, root / "a2")
    bad = _bad_adapters(root, root / "a1", outside)

    async def main() -> None:
        app, model, client = build_lora_app(tmp_path / "base", [str(root)])
        await model.start_engine()
        async with client:
            before = {m: await complete(client, m) for m in ("base", "a1")}
            for i, (path, why) in enumerate(bad.items()):
                load = client.post("/openai/v1/load_lora_adapter",
                                   json={"lora_name": f"bad{i}", "lora_path": path})
                r, during = await asyncio.gather(load, complete(client, "a1"))
                assert r.status_code == 400, (path, r.text)
                assert why in r.json()["error"]["message"], (path, r.text)
                assert during == before["a1"]
            assert not (tmp_path / "PICKLE_RAN").exists()
            names = [m["id"] for m in (await client.get("/openai/v1/models")).json()["data"]]
            assert names == ["base", "a1"]
            assert {m: await complete(client, m) for m in ("base", "a1")} == before
            r = await client.post("/openai/v1/load_lora_adapter",
                                  json={"lora_name": "a2", "lora_path": str(root / "a2")})
            assert r.status_code == 200, r.text
            assert await complete(client, "a2") not in (before["base"], before["a1"])
            stats = model.llm.stats()
            assert stats["num_running"] == stats["num_waiting"] == 0
        model.stop_engine()
    asyncio.run(main())
