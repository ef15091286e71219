"""A user stage that scores a rollout's samples with an external judge over HTTP (blueprints/tiny-judge.yaml).

The judge is any service that answers `POST {"prompt_row", "response", "ground_truth"}` with `{"score": float}`
(an LLM-as-judge API, a grader service); tests/test_phases.py starts a stub. Options: `url`, `timeout_s`, and
`api_key_env`, the name of an environment variable holding a bearer token (read at run time, never written).
"""

import json
import os
import urllib.request

from verlflow.core.userstage import UserStage


class JudgeStage(UserStage):
    inputs = ("rollout",)
    outputs = ("judged.parquet",)

    def run(self, ctx) -> dict:
        if not ctx.is_main():  # one rank asks the judge; the others only join the commit
            return {}
        import pyarrow as pa
        import pyarrow.parquet as pq

        samples = pq.read_table(ctx.input("rollout") / "samples.parquet").to_pylist()
        scores = [self._score(s) for s in samples]
        table = pa.table({**{k: [s[k] for s in samples] for k in ("sample", "row", "response", "score")},
                          "judge_score": scores})
        pq.write_table(table, str(ctx.out / "judged.parquet"))
        agree = sum((j > 0.5) == (s["score"] > 0.5) for j, s in zip(scores, samples))
        return {"judged": len(scores), "judge_mean": sum(scores) / len(scores),
                "agreement_with_reward": agree / len(scores)}

    def _score(self, sample: dict) -> float:
        body = json.dumps({"prompt_row": sample["row"], "response": sample["response"],
                           "ground_truth": sample["ground_truth"]}).encode()
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get(self.options.get("api_key_env", ""), ""):
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.options["url"], data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=float(self.options.get("timeout_s", 10))) as resp:
            return float(json.loads(resp.read())["score"])
