"""`python -m kserve_paged_engine prepare [--model ID]` converts a packaged model; `generate "text"` runs one
offline."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kserve_paged_engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="install and convert a packaged model once (default: "
                          "the default model); print its path")
    prep.add_argument("--model", default=None,
                      help="packaged model id (smollm2-135m-instruct, gemma3-270m)")
    gen = sub.add_parser("generate", help="complete a prompt with the offline engine")
    gen.add_argument("prompt", nargs="*", default=["The capital of France is"])
    gen.add_argument("--model", default=None,
                     help="local HF folder, .gguf, or packaged model id (default model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--dtype", default="auto",
                     help="auto (the default model: 4-bit from its GGUF, float32 activations "
                     "on our int4 kernel), float32, bfloat16: the default model dense")
    gen.add_argument("--quantization", default=None,
                     help="as the server's flag (gguf, int4, int8, ...)")
    args = ap.parse_args(argv)
    from kserve_paged_engine.frontend.installation import check_or_exit

    check_or_exit()  # a broken environment in words, before transformers can fail inside
    if args.cmd == "prepare":
        from kserve_paged_engine.frontend.default_model import DEFAULT_MODEL_ID
        from kserve_paged_engine.frontend.default_model import main as prepare
        return prepare(args.model or DEFAULT_MODEL_ID)
    from kserve_paged_engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    prompt = " ".join(args.prompt)
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
