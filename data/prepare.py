"""Build problem files {id, problem, answer, source} (JSONL) from the Hugging Face hub or local files.

    python data/prepare.py --name=deepscaler --out=data/deepscaler.jsonl     # from the hub
    python data/prepare.py --name=math500 --input=../shared/data/math500/math500.jsonl --out=data/benchmarks/math500.jsonl

Local inputs may be JSONL, JSON (a list) or parquet, with the problem in `problem`/`question`/`prompt`
and the answer in `answer`/`final_answer`/`solution` (last \\boxed{} taken from a solution). Rows
without an answer are refused and counted. Hub sources are listed in SOURCES; the commit a file was
built from goes to <out>.source.json, and rebuilding the file downloads that same commit.
On a box without the hub, copy the prepared files (and their .source.json) and point run_stages.sh at
them: TRAIN_DATA=<file> EVAL_DATA_DIR=<dir of <benchmark>.jsonl>.
"""
import hashlib
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mu_grpo import common  # noqa: E402
import reward  # noqa: E402

# name → (hub dataset, config, split); fields are found by the names tried in `to_row`. The hub commit
# each file was built from is resolved at download and recorded beside it (<out>.source.json); a
# rebuild reads that record and downloads the same commit (--revision=<sha> pins one explicitly).
SOURCES = {
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", None, "train"),
    "math_train": ("DigitalLearningGmbH/MATH-lighteval", "default", "train"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": ("math-ai/aime25", None, "test"),
    "amc23": ("math-ai/amc23", None, "test"),
    "amc24": ("rawsh/2024_AMC12", None, "train"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "minerva_math": ("math-ai/minervamath", None, "test"),
    "olympiadbench": ("math-ai/olympiadbench", None, "test"),
}

# ----------------------------------------------------------------------------- hyperparameters
name = "math500"        # dataset name (a key of SOURCES, or any label with --input)
input = ""              # local file instead of the hub
revision = ""           # hub commit to download (default: the one in <out>.source.json, else the newest)
out = ""                # output JSONL (default: data/<name>.jsonl)
# -----------------------------------------------------------------------------


def to_row(raw, index, source):
    """One normalized row, or None when it has no answer."""
    problem = raw.get("problem") or raw.get("question") or raw.get("prompt")
    answer = raw.get("answer")
    if answer is None and raw.get("final_answer") is not None:
        fa = raw["final_answer"]
        answer = ", ".join(map(str, fa)) if isinstance(fa, list) else fa
    if isinstance(answer, str) and "####" in answer:           # GSM8K: the number after ####
        answer = answer.split("####")[-1].strip().replace(",", "")
    if answer is None and raw.get("solution"):
        answer = reward.last_boxed(str(raw["solution"]))
    if problem is None or answer is None or str(answer).strip() == "":
        return None
    answer = str(answer).strip().strip("$")
    if isinstance(raw.get("answer"), float) and float(answer).is_integer():
        answer = str(int(float(answer)))
    rid = raw.get("id") or raw.get("unique_id") or raw.get("problem_id") or f"{source}-{index}"
    return {"id": str(rid), "problem": str(problem), "answer": answer, "source": source}  # source picks grading rules


def read_local(path):
    p = Path(path)
    if p.suffix == ".parquet":
        import pandas as pd  # pandas: only for a parquet file
        return pd.read_parquet(p).to_dict("records")
    if p.suffix == ".json":
        return json.loads(p.read_text())
    return common.read_jsonl(p)


def source_record_path(out):
    return Path(str(out) + ".source.json")


def resolve_revision(hub, revision):
    """The commit SHA of a hub dataset at `revision` (a branch, tag or SHA; "" = main). A local
    dataset directory (as `datasets.load_dataset` takes one) has no commit: None. A full SHA is
    returned as it is (no hub call: a recorded commit rebuilds from the cache offline)."""
    if Path(hub).is_dir():
        return None
    if re.fullmatch(r"[0-9a-f]{40}", revision or ""):
        return revision
    from huggingface_hub import HfApi  # huggingface_hub: only for a hub dataset
    return HfApi().dataset_info(hub, revision=revision or None).sha


def prepare(name, out, input="", revision="", sources=SOURCES):
    """Write the normalized JSONL for `name` (from `input` if given, else the hub) to `out`, and where
    it came from to <out>.source.json (the hub commit, or the local file's SHA-256)."""
    record_path = source_record_path(out)
    if input:
        raws = read_local(input)
        record = {"name": name, "input": str(input), "sha256": hashlib.sha256(Path(input).read_bytes()).hexdigest()}
    else:
        if name not in sources:
            raise ValueError(f"unknown dataset {name!r}: hub sources are {', '.join(sources)} (or pass --input)")
        from datasets import load_dataset  # datasets: only for a hub dataset
        hub, config, split = sources[name]
        if not revision and record_path.exists():
            revision = json.loads(record_path.read_text()).get("revision") or ""
        sha = resolve_revision(hub, revision)
        raws = list(load_dataset(hub, config, split=split, revision=sha))
        record = {"name": name, "hub": hub, "config": config, "split": split, "revision": sha}
    rows, refused = [], 0
    for i, raw in enumerate(raws):
        row = to_row(dict(raw), i, name)
        if row is None:
            refused += 1
        else:
            rows.append(row)
    if not rows:
        raise ValueError(f"{input or name}: no usable rows ({refused} without problem or answer)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    common.atomic_write_lines(out, rows)
    common.atomic_write_json(record_path, {**record, "rows": len(rows), "refused": refused})
    return len(rows), refused


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    target = out or os.path.join("data", f"{name}.jsonl")
    try:
        n, refused = prepare(name, target, input, revision)
    except Exception as e:          # the hub path: offline, unknown dataset, timeout (httpx errors are not OSErrors)
        if input:
            raise
        sys.exit(f"could not fetch the dataset {name!r} from the hub ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                 f"offline, prepare it elsewhere and copy it here, or convert a local copy with --input=<file>, "
                 f"then point the run at it: TRAIN_DATA=<file> (training) or EVAL_DATA_DIR=<dir> (benchmarks)")
    print(f"{target}: {n} rows" + (f"; refused {refused} rows without an answer" if refused else ""))
