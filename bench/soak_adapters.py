"""The soak's two LoRA adapters: made with PEFT for the default model's shapes, then unloaded
and loaded again through the server's runtime routes while requests use them.

Small on purpose (rank 4, two target modules each): the soak tests the loading machinery and
the mixing of adapters in a batch, not adapter quality.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
from soak_client import Outcome, send
from soak_requests import ADAPTERS, LOAD, UNLOAD, Spec

TARGETS = {"a1": (1, ["q_proj", "v_proj"]), "a2": (2, ["up_proj", "down_proj"])}
RANK = 4


def make_adapters(base: Path, folder: Path) -> dict[str, Path]:
    """Random rank-4 PEFT adapters of `base` in folder/a1 and folder/a2 (kept if there)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, (seed, targets) in TARGETS.items():
        path = folder / name
        paths[name] = path
        if (path / "adapter_model.safetensors").exists():
            continue
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
        pm = peft.get_peft_model(model, peft.LoraConfig(
            r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=targets))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_" in pname:  # PEFT starts B at zero: make the delta count
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        pm.save_pretrained(path)
    return paths


def load_spec(name: str, path: Path) -> Spec:
    return Spec("adapter_load", 0, LOAD, {"lora_name": name, "lora_path": str(path)})


def unload_spec(name: str) -> Spec:
    return Spec("adapter_unload", 0, UNLOAD, {"lora_name": name})


async def cycle(session: aiohttp.ClientSession, base_url: str, paths: dict[str, Path],
                stop_at: float, period_s: float, gap_s: float, timeout_s: float,
                outcomes: list[Outcome], events: list[dict]) -> None:
    """Every `period_s`, unload one adapter (alternating), wait `gap_s`, load it again.

    `events` gets {"name", "action", "sent", "done", "status"} per call (monotonic times), from
    which soak_checks knows when each adapter was surely loaded or surely not. A cycle that has
    begun is always finished, so both adapters are loaded at the end.
    """
    i = 0
    while time.monotonic() + period_s + gap_s < stop_at:
        await asyncio.sleep(period_s)
        name = ADAPTERS[i % len(ADAPTERS)]
        for action, spec in (("unload", unload_spec(name)), ("load", load_spec(name, paths[name]))):
            out = await send(session, base_url, spec, timeout_s)
            outcomes.append(out)
            events.append({"name": name, "action": action, "sent": out.t_send,
                           "done": out.t_end, "status": out.status})
            if action == "unload":
                await asyncio.sleep(gap_s)
        i += 1
