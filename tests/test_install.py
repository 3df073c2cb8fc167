"""The installed environment as a new user's: none of our import names is owned by another
distribution, and transformers (with Hugging Face's `kernels` hub package beside it, which
transformers >= 5.25 requires and imports) runs in one process with our engine.

Before engine/ and kernels/ became source roots of uniquely named packages, our top-level
`kernels` shadowed Hugging Face's: `from transformers import LlamaForCausalLM` failed with
"cannot import name 'CUDAProperties' from 'kernels'" from a checkout, and `pip install .`
wrote our files over theirs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kserve_paged_engine import installation
from tests.helpers.layout import PACKAGES, REPO


def test_our_import_names_are_the_packages_of_the_checkout() -> None:
    assert set(PACKAGES) == set(installation.PACKAGES)


def test_no_import_name_of_ours_is_provided_by_another_distribution() -> None:
    try:
        dist = metadata.distribution(installation.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.fail("kserve-paged is not installed: run `bash scripts/setup.sh`")
    declared = set((dist.read_text("top_level.txt") or "").split())
    assert declared == set(installation.PACKAGES), declared
    owners = metadata.packages_distributions()
    shared = {name: owners.get(name) for name in declared
              if set(owners.get(name, [])) != {installation.DISTRIBUTION}}
    assert shared == {}
    assert installation.problems() == []


# Runs in a child from the repository root (the current directory first on sys.path, as in
# `python -m pytest` and scripts/serve.sh): transformers' Llama and hub-kernels integration,
# then our engine serving one greedy request on a tiny random Llama, against transformers.
_CHILD = r"""
import json, sys, tempfile
from importlib import metadata
from pathlib import Path

import torch
import kernels
from transformers import LlamaForCausalLM
import transformers.integrations.hub_kernels

from kserve_paged_engine import LLM, SamplingParams
from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

folder = Path(tempfile.mkdtemp())
_, ref = save_checkpoint(CONFIGS["llama_gqa_llama3"], folder)
save_tokenizer(folder)
prompt = [5, 9, 3, 17, 2, 44, 61]
ids = list(prompt)
with torch.inference_mode():
    for _ in range(6):
        ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=32, max_model_len=128)
out = llm.generate([{"prompt_token_ids": prompt}],
                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
print("RESULT " + json.dumps({
    "kernels_file": kernels.__file__, "kernels_owners": metadata.packages_distributions()["kernels"],
    "llama": LlamaForCausalLM.__module__, "got": list(out[0].outputs[0].token_ids),
    "expected": ids[len(prompt):]}))
"""


@pytest.mark.slow
def test_transformers_llama_and_our_engine_serve_in_one_process_with_hf_kernels() -> None:
    try:
        hf_kernels = metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.fail("Hugging Face's `kernels` is not installed (the dev extra installs it)")
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    # The `kernels` imported is Hugging Face's, from site-packages, not a folder of ours.
    assert Path(result["kernels_file"]).parent.parent.name.endswith("-packages"), result
    assert result["kernels_owners"] == ["kernels"], (hf_kernels, result)
    assert result["llama"].startswith("transformers.")
    assert result["got"] == result["expected"] and len(result["got"]) == 6, result


# Runs in a child outside the checkout, with the built wheel installed into a folder of its own
# first on the path: the image's non-editable install, next to transformers and HF's `kernels`.
_WHEEL_CHILD = r"""
import json, sys

import kernels
from transformers import LlamaForCausalLM
import transformers.integrations.hub_kernels

import kserve_paged, kserve_paged_engine, kserve_paged_kernels
from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_kernels import cpu_native

llm = LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=32, max_model_len=128)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
print("RESULT " + json.dumps({
    "files": [m.__file__ for m in (kserve_paged, kserve_paged_engine, kserve_paged_kernels)],
    "kernels_file": kernels.__file__, "native": cpu_native.load() is not None,
    "got": list(out[0].outputs[0].token_ids)}))
"""


@pytest.mark.slow
def test_the_wheel_serves_beside_transformers_and_hf_kernels(tmp_path: Path) -> None:
    import torch

    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    wheels, site, model = tmp_path / "wheels", tmp_path / "site", tmp_path / "model"
    source = tmp_path / "source"  # a copy: setuptools writes build/ beside what it builds
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(REPO / name, source / name)
    for folder in {f.relative_to(REPO).parts[0] for f in PACKAGES.values()}:
        shutil.copytree(REPO / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("kserve_paged-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    assert not (site / "kernels").exists() and not (site / "engine").exists()
    assert (site / "kserve_paged_kernels" / "csrc" / "kp_native.h").is_file()

    _, ref = save_checkpoint(CONFIGS["llama_gqa_llama3"], model)
    save_tokenizer(model)
    prompt = [5, 9, 3, 17, 2, 44, 61]
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(6):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))

    env = dict(os.environ, PYTHONPATH=str(site), KSERVE_PAGED_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _WHEEL_CHILD, str(model), json.dumps(prompt)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert all(Path(f).is_relative_to(site) for f in result["files"]), result
    assert Path(result["kernels_file"]).parent.parent.name.endswith("-packages"), result
    assert result["native"] is True  # the native library built from the wheel's own sources
    assert result["got"] == ids[len(prompt):], result
