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

from kserve_paged_engine.frontend import installation
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


# One process: Hugging Face's `kernels`, transformers' Llama (with its hub-kernels integration,
# which imports `kernels` at module level) greedy on a tiny checkpoint, and our engine serving
# the same request.
_CHILD = r"""
import json, sys
from importlib import metadata

import torch
import kernels
import transformers.integrations.hub_kernels
from transformers import LlamaForCausalLM

import kserve_paged, kserve_paged_engine, kserve_paged_kernels
from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_kernels import cpu_native

folder, prompt = sys.argv[1], [5, 9, 3, 17, 2, 44, 61]
ref = LlamaForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                       attn_implementation="eager").eval()
ids = list(prompt)
with torch.inference_mode():
    for _ in range(6):
        ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
llm = LLM(model=folder, dtype="float32", num_kv_blocks=32, max_model_len=128)
out = llm.generate([{"prompt_token_ids": prompt}],
                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
print("RESULT " + json.dumps({
    "files": [m.__file__ for m in (kserve_paged, kserve_paged_engine, kserve_paged_kernels)],
    "kernels_file": kernels.__file__, "kernels_owners": metadata.packages_distributions()["kernels"],
    "native": cpu_native.load() is not None,
    "got": list(out[0].outputs[0].token_ids), "expected": ids[len(prompt):]}))
"""


def _serve_in_a_child(tmp_path: Path, cwd: Path, env: dict[str, str] | None = None) -> dict:
    """Save a tiny random Llama, run _CHILD on it from `cwd`, return what it printed."""
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    folder = tmp_path / "model"
    save_checkpoint(CONFIGS["llama_gqa_llama3"], folder)
    save_tokenizer(folder)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    # The `kernels` imported is Hugging Face's, from site-packages, not a folder of ours.
    assert Path(result["kernels_file"]).parent.parent.name.endswith("-packages"), result
    assert result["kernels_owners"] == ["kernels"], result
    assert result["got"] == result["expected"] and len(result["got"]) == 6, result
    return result


@pytest.mark.slow
def test_transformers_llama_and_our_engine_serve_in_one_process_with_hf_kernels(
        tmp_path: Path) -> None:
    """From the repository root: the current directory first on sys.path, as in `python -m
    pytest` and scripts/serve.sh, where our old `kernels/` shadowed Hugging Face's."""
    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.fail("Hugging Face's `kernels` is not installed (the dev extra installs it)")
    _serve_in_a_child(tmp_path, cwd=REPO)


@pytest.mark.slow
def test_the_wheel_serves_beside_transformers_and_hf_kernels(tmp_path: Path) -> None:
    """The image's non-editable install: the built wheel in a folder of its own, first on the
    path, run from outside the checkout."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    source = tmp_path / "source"  # a copy: setuptools writes build/ beside what it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
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

    env = dict(os.environ, PYTHONPATH=str(site), KSERVE_PAGED_CACHE=str(tmp_path / "cache"))
    result = _serve_in_a_child(tmp_path, cwd=tmp_path, env=env)
    assert all(Path(f).is_relative_to(site) for f in result["files"]), result
    assert result["native"] is True  # the native library, built from the wheel's own sources
