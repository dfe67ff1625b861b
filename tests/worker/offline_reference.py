"""Greedy reference outputs from vLLM's offline ``LLM.generate`` (run as a subprocess).

Usage: python offline_reference.py SPEC.json OUT.json (vLLM logs to stdout), where SPEC is a list of
{"model": dir, "solo": [[ids], ...], "batch": [[ids], ...], "max_tokens": n, "dtype": d}. Solo prompts
are generated one per call (batch of one, like sequential gRPC calls); batch prompts in
one call (like GenerateBatch).
"""

from __future__ import annotations

import contextlib
import json
import sys


def run(llm: object, params: object, prompts: list[list[int]]) -> list[list[int]]:
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(  # type: ignore[attr-defined]
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as spec_file:
        specs = json.load(spec_file)
    results = []
    for spec in specs:
        llm = LLM(model=spec["model"], enforce_eager=True, seed=0, dtype=spec.get("dtype", "auto"))
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False)
        solo = [run(llm, params, [p])[0] for p in spec["solo"]]
        batch = run(llm, params, spec["batch"]) if spec["batch"] else []
        results.append({"model": spec["model"], "solo": solo, "batch": batch})
        with contextlib.suppress(Exception):  # free the engine before the next model starts
            llm.llm_engine.engine_core.shutdown()
        del llm
    with open(sys.argv[2], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
