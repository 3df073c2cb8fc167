"""Issue 49 item 7 and vLLM's adapter paths, through the server in process on a tiny random
Llama with tiny random PEFT adapters:

- an adapter may not take a name the base model is served under (it took the alias's v2
  traffic, and unloading it removed the alias);
- every read of a runtime adapter, the re-read after an LRU eviction included, stays under
  --lora_roots: the folder is opened once and read through its descriptor, so a folder
  swapped for a link to elsewhere is never followed (engine/kserve_paged_engine/lora/folder.py);
- vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter answer as the /openai/v1/ ones,
  switched on by --enable_lora_runtime_updates or vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged.args import engine_kwargs, parse_args  # noqa: E402
from kserve_paged.lora import LoRAError  # noqa: E402
from kserve_paged_engine.lora import LoRARequest  # noqa: E402
from tests.helpers.lora import make_adapter, tiny_base  # noqa: E402
from tests.helpers.lora_server import PROMPT, build_lora_app, complete  # noqa: E402
from tests.helpers.server import FakeEngine, build, client, run  # noqa: E402

LOAD, UNLOAD = "/openai/v1/load_lora_adapter", "/openai/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    """base/, roots/a1, roots/a2 and outside/evil: three adapters of different outputs."""
    top = tmp_path_factory.mktemp("lora49")
    tiny_base(top / "base")
    for folder, seed in (("roots/a1", 1), ("roots/a2", 2), ("outside/evil", 3)):
        make_adapter(top / "base", top / folder, seed=seed, r=4, lora_alpha=8,
                     target_modules=["q_proj", "v_proj", "o_proj"])
    return top


async def _v2_text(c: httpx.AsyncClient, name: str) -> str:
    r = await c.post(f"/v2/models/{name}/infer", json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                    "data": ["one two three"]}],
        "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]["data"][0]


def test_an_adapter_cannot_take_a_name_the_model_is_served_under(dirs):
    async def main() -> None:
        app, model, c = build_lora_app(dirs / "base", [str(dirs / "roots")], [],
                                       names=["base", "alias"])
        await model.start_engine()
        async with c:
            base_text = await _v2_text(c, "base")
            for name in ("alias", "base"):
                r = await c.post(LOAD, json={"lora_name": name,
                                             "lora_path": str(dirs / "roots" / "a1")})
                assert r.status_code == 400, (name, r.text)
                assert "served model's name" in r.json()["error"]["message"]
            assert await _v2_text(c, "alias") == base_text  # still the base model's traffic
            r = await c.post(UNLOAD, json={"lora_name": "alias"})
            assert r.status_code == 404, r.text
            assert (await c.get("/v2/models/alias/ready")).status_code == 200
            ids = [m["id"] for m in (await c.get("/openai/v1/models")).json()["data"]]
            assert ids == ["base", "alias"]
            with pytest.raises(LoRAError, match="served model's name"):  # start-up names too
                model.alias_lora("alias", LoRARequest("a1", 99, str(dirs / "roots" / "a1")))
            assert model.loras == {}
        model.stop_engine()
    asyncio.run(main())


def test_a_reread_after_eviction_stays_in_the_folder_first_read(dirs, tmp_path):
    """One adapter kept loaded (--max_cpu_loras 1): each request to a1 after one to a2 reads
    a1 again. Its folder is meanwhile renamed and a link to an adapter outside the roots put
    in its place: a1 must still be a1, and refused once its folder left the roots or went."""
    roots, outside = tmp_path / "roots", dirs / "outside"
    shutil.copytree(dirs / "roots", roots)

    async def refused(c: httpx.AsyncClient, why: str) -> None:
        r = await c.post("/openai/v1/completions", json={
            "model": "a1", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 400, r.text
        assert why in r.json()["error"]["message"], r.text

    async def main() -> None:
        app, model, c = build_lora_app(dirs / "base", [str(roots)],
                                       [("evil", str(outside / "evil"))],
                                       max_loras=1, max_cpu_loras=1)
        await model.start_engine()
        async with c:
            for name in ("a1", "a2"):
                r = await c.post(LOAD, json={"lora_name": name, "lora_path": str(roots / name)})
                assert r.status_code == 200, r.text
            base, a1, evil = [await complete(c, m) for m in ("base", "a1", "evil")]
            a2 = await complete(c, "a2")  # a1 is evicted
            assert len({base, a1, evil, a2}) == 4
            assert await model.llm.call_engine(lambda e: e.list_loras()) == [
                model.loras["a2"].lora_int_id]
            os.rename(roots / "a1", roots / "a1-moved")  # still under the roots
            (roots / "a1").symlink_to(outside / "evil", target_is_directory=True)
            assert await complete(c, "a1") == a1
            await complete(c, "a2")
            os.rename(roots / "a1-moved", tmp_path / "a1-out")  # out of the roots
            await refused(c, "outside the adapter roots")
            os.rename(tmp_path / "a1-out", roots / "a1-moved")  # back in: served again
            assert await complete(c, "a1") == a1
            await complete(c, "a2")
            shutil.rmtree(roots / "a1-moved")
            await refused(c, "was deleted")
            assert [await complete(c, m) for m in ("base", "a2", "evil")] == [base, a2, evil]
            stats = model.llm.stats()
            assert stats["num_running"] == stats["num_waiting"] == 0
        model.stop_engine()
    asyncio.run(main())


def test_vllms_own_adapter_paths_load_and_unload(dirs):
    async def main() -> None:
        app, model, c = build_lora_app(dirs / "base", [str(dirs / "roots")], [])
        await model.start_engine()
        async with c:
            r = await c.post("/v1/load_lora_adapter", json={
                "lora_name": "v", "lora_path": str(dirs / "roots" / "a2")})
            assert r.status_code == 200, r.text
            assert r.text == "Success: LoRA adapter 'v' added successfully."
            text = await complete(c, "v")
            assert text != await complete(c, "base")
            r = await c.post("/v1/load_lora_adapter", json={
                "lora_name": "w", "lora_path": str(dirs / "outside" / "evil")})
            assert r.status_code == 400 and "outside the adapter roots" in r.text
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "v"})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", json={"model": "v", "prompt": PROMPT,
                                                      "max_tokens": 2})
            assert r.status_code == 404, r.text
        model.stop_engine()
    asyncio.run(main())


def test_vllms_adapter_paths_are_refused_with_runtime_updates_off():
    async def main() -> None:
        app, model = build(engine=FakeEngine(), lora_runtime_updates=False)
        async with client(app) as c:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                r = await c.post(path, json={"lora_name": "x", "lora_path": "/mnt/lora/x"})
                assert r.status_code == 404
                assert "--enable_lora_runtime_updates" in r.json()["error"]["message"]
    run(main())


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" True ", True),
                                       ("0", False), ("", False), ("yes", False)])
def test_vllms_variable_turns_runtime_updates_on(value, on, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    args = parse_args([])
    assert args.enable_lora_runtime_updates is on
    assert engine_kwargs(args)["enable_lora"] is on
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert parse_args(["--enable_lora_runtime_updates"]).enable_lora_runtime_updates


# -- the folder itself (engine/kserve_paged_engine/lora/folder.py), no model -------------------

def test_a_folder_is_opened_without_following_a_link_and_checked_where_it_is_now(
        tmp_path, monkeypatch):
    from kserve_paged_engine.lora import folder as folder_module
    from kserve_paged_engine.lora.folder import AdapterFolder

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("s")
    os.mkfifo(root / "fifo")
    with pytest.raises(ValueError, match="not a folder"):
        AdapterFolder(str(root / "fifo"), [str(root)])  # refused at once, not blocked
    with pytest.raises(ValueError, match="outside the adapter roots"):
        AdapterFolder(str(outside), [str(root)])
    # A link put in the path after it was resolved (realpath saw none) is not followed.
    (root / "swapped").symlink_to(outside, target_is_directory=True)
    monkeypatch.setattr(folder_module.os.path, "realpath", lambda p: os.path.normpath(p))
    with pytest.raises(ValueError, match="symbolic link"):
        AdapterFolder(str(root / "swapped"), [str(root)])
    monkeypatch.undo()
    held = AdapterFolder(str(root / "a"), [str(root)])
    (root / "a" / "adapter_config.json").write_text("{}")
    os.rename(root / "a", root / "b")  # moved inside the roots: still the same folder
    held.check()
    assert held.has("adapter_config.json") and not held.has("secret")
    os.rename(root / "b", tmp_path / "c")
    with pytest.raises(ValueError, match="outside the adapter roots"):
        held.check()
    shutil.rmtree(tmp_path / "c")
    with pytest.raises(ValueError, match="was deleted"):
        held.check()
    held.close()
    operator = AdapterFolder(str(root / "swapped"))  # not confined: the link is resolved once
    operator.check()
    assert operator.path == str(outside) and operator.has("secret")
    operator.close()
