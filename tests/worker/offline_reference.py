"""Greedy reference outputs from vLLM's offline ``LLM.generate`` (run as a subprocess).

Usage: python offline_reference.py SPEC.json > OUT.json, where SPEC is a list of
{"model": dir, "solo": [[ids], ...], "batch": [[ids], ...], "max_tokens": n}. Solo prompts
are generated one per call (batch of one, like sequential gRPC calls); batch prompts in
one call (like GenerateBatch).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    specs = json.loads(open(sys.argv[1]).read())
    results = []
    for spec in specs:
        llm = LLM(model=spec["model"], enforce_eager=True, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False)

        def run(prompts: list[list[int]]) -> list[list[int]]:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                   use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]

        solo = [run([p])[0] for p in spec["solo"]]
        batch = run(spec["batch"]) if spec["batch"] else []
        results.append({"model": spec["model"], "solo": solo, "batch": batch})
        del llm
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
