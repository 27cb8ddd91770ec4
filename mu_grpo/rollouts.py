"""The rollout files (docs/design.md §3): written by generate.py, read by optimize.py.

A stage's `rollouts/` directory holds JSONL shards, the readable contract (one line per response),
and beside each shard its **columns**: the numbers training needs, as flat binary arrays that every
training rank memory-maps instead of parsing JSON.

    rollouts/shard_00000.jsonl                      one response per line (REQUIRED fields and more)
    rollouts/columns/shard_00000/<name>.bin         raw little-endian arrays (COLUMNS)
    rollouts/columns/shard_00000/columns.json       counts, group keys, and the JSONL they were built from

generate.py writes a shard's columns as it writes the shard; open_stage() builds them from the JSONL,
streaming and validating line by line, when they are absent or older than the JSONL (an edited shard).

Why raw arrays described by a JSON file, rather than .npy or Arrow: they are appended to row by row
while a shard is parsed, so building them needs no more memory than one line; np.memmap reads them
with nothing beyond numpy (a notebook too: np.fromfile(path, dtype)); and a token's position in the
stage is a plain offset, which the per-stage log-prob passes (TokenColumn) share.
"""
import collections
import concurrent.futures
import io
import json
import math
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np

from mu_grpo import common, records

try:
    import orjson
except ImportError:          # 5-7× faster parsing of the token lists; plain json works too
    orjson = None

REQUIRED = ("prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids", "behavior_logprobs",
            "finish_reason", "reward", "advantage", "stage", "policy")
FINISH_REASONS = ("stop", "length", "abort", "error")      # stored as their index; only stop/length train
TRAINABLE_FINISH = ("stop", "length")
# name → dtype; *_ids, behavior_logprobs per token; *_offsets per response + 1; the rest per response
COLUMNS = {
    "prompt_ids": "<i4", "prompt_offsets": "<i8",
    "response_ids": "<i4", "behavior_logprobs": "<f4", "response_offsets": "<i8",
    "reward": "<f4", "advantage": "<f4", "sample_idx": "<i4", "group": "<i4", "finish": "<i1", "line": "<i4",
}
VERSION = 1


class RolloutError(ValueError):
    """A rollout file that cannot be trained on; the message names the file and line."""


def dumps(row):
    return orjson.dumps(row) + b"\n" if orjson else (json.dumps(row, separators=(",", ":")) + "\n").encode()


def _loads(text):
    if orjson:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass             # maybe NaN/Infinity, which only the standard parser reads (then refused below)
    return json.loads(text)


# ----------------------------------------------------------------------------------------------
# Writing: JSONL shard + columns


class ColumnWriter:
    """Appends rows to a shard's columns in a temporary directory; close() renames it into place."""

    def __init__(self, directory):
        self.final = Path(directory)
        self.tmp = self.final.with_name(f".{self.final.name}.tmp{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.files = {name: open(self.tmp / f"{name}.bin", "wb") for name in COLUMNS}
        self.group_keys, self.group_index = [], {}
        self.n = self.prompt_tokens = self.response_tokens = self.max_token_id = 0
        self.files["prompt_offsets"].write(np.zeros(1, "<i8").tobytes())
        self.files["response_offsets"].write(np.zeros(1, "<i8").tobytes())

    def add(self, row, line, where):
        """Validate one row (errors name `where`, e.g. file:line) and append it."""
        for field in REQUIRED:
            if field not in row:
                raise RolloutError(f"{where}: missing field {field!r}")
        prompt, response = row["prompt_token_ids"], row["response_token_ids"]
        if not prompt or not response:
            raise RolloutError(f"{where}: empty prompt_token_ids or response_token_ids")
        if len(response) != len(row["behavior_logprobs"]):
            raise RolloutError(f"{where}: {len(response)} response tokens but {len(row['behavior_logprobs'])} "
                               f"behavior_logprobs")
        behavior = np.asarray(row["behavior_logprobs"], dtype="<f4")
        if not np.isfinite(behavior).all():
            raise RolloutError(f"{where}: non-finite value in behavior_logprobs")
        if not (math.isfinite(row["advantage"]) and math.isfinite(row["reward"])):
            raise RolloutError(f"{where}: non-finite reward or advantage")
        if row["finish_reason"] not in FINISH_REASONS:
            raise RolloutError(f"{where}: finish_reason {row['finish_reason']!r} is not one of {FINISH_REASONS}")
        key = row.get("group", row["prompt_id"])
        if key not in self.group_index:
            self.group_index[key] = len(self.group_keys)
            self.group_keys.append(key)
        self.prompt_tokens += len(prompt)
        self.response_tokens += len(response)
        f = self.files
        prompt, response = np.asarray(prompt, dtype="<i4"), np.asarray(response, dtype="<i4")
        self.max_token_id = max(self.max_token_id, int(prompt.max(initial=0)), int(response.max(initial=0)))
        f["prompt_ids"].write(prompt.tobytes())
        f["response_ids"].write(response.tobytes())
        f["behavior_logprobs"].write(behavior.tobytes())
        f["prompt_offsets"].write(np.array([self.prompt_tokens], "<i8").tobytes())
        f["response_offsets"].write(np.array([self.response_tokens], "<i8").tobytes())
        for name, value in (("reward", row["reward"]), ("advantage", row["advantage"]),
                            ("sample_idx", row["sample_idx"]), ("group", self.group_index[key]),
                            ("finish", FINISH_REASONS.index(row["finish_reason"])), ("line", line)):
            f[name].write(np.array([value], COLUMNS[name]).tobytes())
        self.n += 1

    def close(self, source):
        """Finish: columns.json names the JSONL `source` (size and mtime, to notice later edits)."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        stat = Path(source).stat()
        meta = {"version": VERSION, "source": Path(source).name, "source_size": stat.st_size,
                "source_mtime_ns": stat.st_mtime_ns, "responses": self.n, "prompt_tokens": self.prompt_tokens,
                "response_tokens": self.response_tokens, "max_token_id": self.max_token_id,
                "group_keys": self.group_keys,
                "dtypes": COLUMNS}
        (self.tmp / "columns.json").write_text(json.dumps(meta))
        self.final.parent.mkdir(parents=True, exist_ok=True)
        old = self.final.with_name(f".{self.final.name}.old{os.getpid()}")
        if self.final.exists():
            os.replace(self.final, old)
        try:
            os.replace(self.tmp, self.final)
        except OSError:          # another process finished the same columns first: keep theirs
            shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self):
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- a stage's rollouts/ directory
# (the run directory's names, rollouts/ and its manifest.json and plan.json among them, and the stage plan: mu_grpo/records.py)


def shard_path(directory, k):
    """Shard k's JSONL in a stage's rollouts directory."""
    return Path(directory) / f"shard_{k:05d}.jsonl"


def stats_path(directory, k):
    """Shard k's statistics, written after its JSONL and columns: the shard is done when both exist."""
    return Path(directory) / f"shard_{k:05d}.stats.json"


def shard_done(directory, k):
    return shard_path(directory, k).exists() and stats_path(directory, k).exists()


def shard_counts(lines, group_size):
    """A shard's counts for its stats file, from its lines (whole groups of group_size, in group order)."""
    rewards, lengths = [x["reward"] for x in lines], [len(x["response_token_ids"]) for x in lines]
    groups = [rewards[j:j + group_size] for j in range(0, len(rewards), group_size)]
    reasons = dict(collections.Counter(x["reward_info"]["reason"] for x in lines))
    return {"responses": len(lines), "reward_sum": sum(rewards),
            "groups_all_correct": sum(min(g) == 1.0 for g in groups),
            "groups_all_wrong": sum(max(g) == 0.0 for g in groups),
            "groups_zero_variance": sum(bool(x["zero_variance"]) for x in lines[::group_size]),
            "response_tokens": sum(lengths), "max_response_tokens": max(lengths, default=0),
            "truncated": sum(x["finish_reason"] == "length" for x in lines), "reasons": reasons}


def stage_summary(stats, plan):
    """The manifest's summary of a stage's shards (their stats files' `stats`, started with `plan`): counts and
    fractions, the graders' reasons, and the engines' time and throughput."""
    total = lambda key: sum(st[key] for st in stats)  # noqa: E731
    responses, groups = total("responses"), total("prompts")
    wall = max(st.get("finished_at", 0.0) for st in stats) - min(st.get("started_at", 0.0) for st in stats)
    reasons, engine_seconds = collections.Counter(), {}
    for st in stats:
        reasons.update(st["reasons"])
        engine_seconds[st.get("engine", 0)] = engine_seconds.get(st.get("engine", 0), 0) + st["generation_seconds"]
    slowest = max(engine_seconds.values(), default=0.0)
    return {
        "prompts": groups, "responses": responses, "skipped_long_prompts": total("skipped_long_prompts"),
        "mean_reward": total("reward_sum") / max(1, responses),
        "frac_groups_all_correct": total("groups_all_correct") / max(1, groups),
        "frac_groups_all_wrong": total("groups_all_wrong") / max(1, groups),
        "frac_groups_zero_variance": total("groups_zero_variance") / max(1, groups),
        "mean_response_tokens": total("response_tokens") / max(1, responses),
        "max_response_tokens": max((st["max_response_tokens"] for st in stats), default=0),
        "truncation_rate": total("truncated") / max(1, responses),
        "grader_reasons": dict(reasons),
        # the engines that generated this stage's shards ran side by side: the stage took its slowest
        # engine's time; tokens/s per engine is what a run with another engine count scales
        "engines_ran": len(engine_seconds),
        "generation_seconds": slowest,
        "generated_tokens_per_s": total("response_tokens") / max(1e-9, slowest),
        "tokens_per_s_per_engine": total("response_tokens") / max(1e-9, total("generation_seconds")),
        # how full an engine's batch could get: sequences it had at once (two shards queued) over its largest
        # batch; an engine far below 1 runs slower per token than a full one
        "batch_saturation": min(1.0, min(responses / max(1, len(engine_seconds)),
                                         2 * math.ceil(plan["prompts_per_stage"] / plan["shards"]) * plan["group_size"])
                                / max(1, max((st.get("max_num_seqs") or 1 for st in stats), default=1))),
        # first request to last shard written (grading and writing included, engine start-up not;
        # on a resumed stage it spans the pause too)
        "wall_seconds": wall,
        "wall_tokens_per_s": total("response_tokens") / max(1e-9, wall),
    }


def remove_temporaries(directory):
    """Delete what a killed writer left half-written in a rollouts directory: common.atomic_write's
    `.<name>.tmp<pid>` beside the shards, ColumnWriter's `.shard_k.tmp<pid>/` (and a replaced `.shard_k.old<pid>/`)
    under columns/. Only the directory's one writer may call it (run_stages.sh holds the run's lock). Returns the
    names removed."""
    directory = Path(directory)
    stale = [*directory.glob(".*.tmp*"), *directory.glob("columns/.*.tmp*"), *directory.glob("columns/.*.old*")]
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return sorted(str(p.relative_to(directory)) for p in stale)


def columns_dir(shard_path):
    shard_path = Path(shard_path)
    return shard_path.parent / "columns" / shard_path.stem


def columns_lock(shard_path):
    """The lock file a builder of the shard's columns holds (beside its columns directory)."""
    return columns_dir(shard_path).with_name(f".{Path(shard_path).stem}.lock")


def write_shard(path, rows):
    """A JSONL shard, atomically (temporary name, fsync, rename), then its columns."""
    common.atomic_write(path, b"".join(dumps(r) for r in rows))
    writer = ColumnWriter(columns_dir(path))
    try:
        for n, row in enumerate(rows, 1):
            writer.add(row, n, f"{path}:{n}")
    except BaseException:
        writer.abort()
        raise
    writer.close(path)


def build_columns(path):
    """Columns of an existing JSONL shard, streaming: one line in memory at a time. Returns its path.

    Processes that open one stage at once (ablate.sh's replays side by side) build a shard's columns once: each
    takes the shard's lock and builds only what is still stale once it holds it. Without the lock the later
    builder swapped its copy in while an earlier one was checking its own, and the check found no columns.
    """
    path = Path(path)
    with common.exclusive(columns_lock(path)):
        if not columns_fresh(path):
            _build_columns(path)
    return str(columns_dir(path))


def _build_columns(path):
    writer = ColumnWriter(columns_dir(path))
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                where = f"{path}:{n}"
                if not line.endswith(b"\n"):
                    raise RolloutError(f"{where}: truncated last line (no newline): the file is incomplete")
                if not line.strip():
                    continue
                try:
                    row = _loads(line)
                except ValueError as e:
                    raise RolloutError(f"{where}: not valid JSON ({e})") from None
                writer.add(row, n, where)
    except BaseException:
        writer.abort()
        raise
    writer.close(path)


def columns_fresh(shard_path):
    """True when the shard's columns exist and were built from the JSONL as it is now."""
    meta_file = columns_dir(shard_path) / "columns.json"
    if not meta_file.exists():
        return False
    meta, stat = json.loads(meta_file.read_text()), Path(shard_path).stat()
    return (meta.get("version") == VERSION and meta["source_size"] == stat.st_size
            and meta["source_mtime_ns"] == stat.st_mtime_ns)


# ----------------------------------------------------------------------------------------------
# Reading: a whole stage, memory-mapped


class Shard:
    def __init__(self, path):
        self.path = Path(path)
        cdir = columns_dir(path)
        self.meta = json.loads((cdir / "columns.json").read_text())
        self.col = {name: np.memmap(cdir / f"{name}.bin", dtype=dtype, mode="r")
                    if (cdir / f"{name}.bin").stat().st_size else np.zeros(0, dtype)
                    for name, dtype in COLUMNS.items()}


class Stage:
    """A complete stage's rollouts, validated and memory-mapped.

    Responses are numbered 0..n−1 in manifest shard order. Per response (numpy arrays [n]):
    prompt_len, response_len, reward, advantage, group (index into groups). groups [n_groups, G]:
    response indices of each group by sample_idx. token_offset [n+1]: where each response's tokens
    start in the stage's concatenated response tokens (the layout of TokenColumn).
    """

    def __init__(self, directory, manifest, shards):
        self.directory, self.manifest, self.shards = Path(directory), manifest, shards
        self.group_size = manifest["sampling"]["n"]
        cat = lambda name: np.concatenate([s.col[name] for s in shards]) if shards else np.zeros(0)  # noqa: E731
        counts = [s.meta["responses"] for s in shards]
        self.n = sum(counts)
        self.shard_of = np.repeat(np.arange(len(shards)), counts)
        self.local = np.concatenate([np.arange(c) for c in counts]) if shards else np.zeros(0, np.int64)
        self.prompt_len = np.concatenate([np.diff(s.col["prompt_offsets"]) for s in shards])
        self.response_len = np.concatenate([np.diff(s.col["response_offsets"]) for s in shards])
        self.token_offset = np.concatenate([[0], np.cumsum(self.response_len)])
        self.reward, self.advantage = cat("reward").astype(np.float32), cat("advantage").astype(np.float32)
        self.finish = cat("finish")
        # groups across shards, by their keys (a prompt may recur in a stage: keys are positions)
        index, group = {}, []
        for s in shards:
            local_to_global = [index.setdefault(json.dumps(k), len(index)) for k in s.meta["group_keys"]]
            group.append(np.asarray(local_to_global, dtype=np.int64)[s.col["group"]])
        self.group = np.concatenate(group) if group else np.zeros(0, np.int64)
        self.group_keys = [json.loads(k) for k in index]
        self._validate(cat("sample_idx"))

    @property
    def index(self):
        """The stage's index in its run (the manifest's)."""
        return self.manifest["stage"]

    @property
    def temperature(self):
        """The temperature the responses were sampled at (their behavior log-probs are at it too)."""
        return self.manifest["sampling"]["temperature"]

    @property
    def max_response_tokens(self):
        """The sampling's response length limit."""
        return self.manifest["sampling"]["max_tokens"]

    def where(self, i):
        s = self.shards[self.shard_of[i]]
        return f"{s.path}:{int(s.col['line'][self.local[i]])}"

    def _validate(self, sample_idx):
        G = self.group_size
        bad = np.flatnonzero(~np.isin(self.finish, [FINISH_REASONS.index(f) for f in TRAINABLE_FINISH]))
        if len(bad):
            raise RolloutError(f"{self.where(bad[0])}: finish_reason {FINISH_REASONS[self.finish[bad[0]]]!r} "
                               f"({len(bad)} such responses): the engine did not finish them, so they cannot "
                               f"be trained on; delete the shard and rerun generate.py to regenerate it")
        size = np.bincount(self.group, minlength=len(self.group_keys))
        order = np.lexsort((sample_idx, self.group))                  # by group, then sample_idx
        ok = size == G
        if ok.all():
            self.groups = order.reshape(-1, G)
            ok = (sample_idx[self.groups] == np.arange(G)).all(axis=1)
        if not ok.all():
            g = int(np.flatnonzero(~ok)[0])
            members = np.flatnonzero(self.group == g)
            raise RolloutError(f"{self.directory}: group {self.group_keys[g]!r} has samples "
                               f"{sorted(sample_idx[members].tolist())}, expected 0..{G - 1} "
                               f"(first line: {self.where(members[0])})")
        rewards = self.reward[self.groups]
        self.zero_variance = (rewards == rewards[:, :1]).all(axis=1)

    def tokens(self, i):
        """(prompt ids, response ids, behavior log-probs) of response i: views into the memory maps."""
        s, j = self.shards[self.shard_of[i]], self.local[i]
        po, ro = s.col["prompt_offsets"], s.col["response_offsets"]
        r = slice(ro[j], ro[j + 1])
        return s.col["prompt_ids"][po[j]:po[j + 1]], s.col["response_ids"][r], s.col["behavior_logprobs"][r]

    def max_token_id(self):
        """The largest token id in the stage, recorded when the columns were built (no scan of the ids)."""
        return max((s.meta["max_token_id"] if "max_token_id" in s.meta else
                    int(max(s.col["prompt_ids"].max(initial=0), s.col["response_ids"].max(initial=0)))
                    for s in self.shards), default=0)


def open_stage(directory, rank=0, world=1, barrier=None, workers=None, decide=None):
    """The validated, memory-mapped rollouts of a complete stage (manifest.json present).

    Shards without fresh columns are built from their JSONL first: under torchrun each rank builds its
    share (shard k on rank k % world) in `workers` processes, then `barrier()` lines the ranks up. Which
    columns are fresh is what rank 0 sees, `decide(value)` returning rank 0's value on every rank (on several
    nodes another node's NFS cache may still show a column as missing or stale).
    Raises RolloutError naming the file and line of the first bad response.
    """
    directory = Path(directory)
    decide = decide or (lambda value: value)
    manifest_file = directory / records.MANIFEST
    if not manifest_file.exists():
        shards = sorted(directory.glob("shard_*.jsonl"))
        raise RolloutError(f"{directory}: no manifest.json ({len(shards)} shards present): the stage's "
                           f"generation is incomplete; rerun generate.py to finish it")
    manifest = json.loads(manifest_file.read_text())
    paths = [directory / name for name in manifest["shards"]]
    for p in paths:
        if not p.exists():
            raise RolloutError(f"{p}: listed in the manifest but missing")
    fresh = decide([columns_fresh(p) for p in paths] if rank == 0 else None)
    todo = [p for k, p in enumerate(paths) if k % world == rank and not fresh[k]]
    workers = min(len(todo), workers or max(1, (os.cpu_count() or 1) // world))
    if workers > 1:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(build_columns, todo))
    else:
        for p in todo:
            build_columns(p)
    if barrier is not None:
        barrier()
    if world > 1:           # the columns other ranks (perhaps on other nodes) built
        common.wait_visible([columns_dir(p) / "columns.json" for p in paths])
    stale = decide([str(p) for p in paths if not columns_fresh(p)] if rank == 0 else None)
    if stale:
        raise RolloutError(f"{stale[0]}: its columns were not built (another rank failed?)")
    return Stage(directory, manifest, [Shard(p) for p in paths])


# ----------------------------------------------------------------------------------------------
# Per-token log-prob columns computed by the trainer (TIS's old log-probs, KL's reference log-probs)


def write_column_part(column_path, rank, seq, indices, values):
    """Rank `rank`'s seq-th part of a TokenColumn pass: the responses `indices` it computed and their per-token
    `values` (arrays, in order), one file written whole beside the column. Returns its path."""
    path = Path(column_path).with_name(f"{Path(column_path).name}.part-r{rank}-{seq:05d}.npz")
    buffer = io.BytesIO()
    np.savez(buffer, indices=np.asarray(indices, dtype=np.int64),
             values=np.concatenate(values).astype("<f4") if values else np.zeros(0, "<f4"))
    common.atomic_write(path, buffer.getvalue())
    return path


class TokenColumn:
    """float32 values per response token of a stage (the Stage.token_offset layout), in one file that rank 0
    alone writes: the ranks compute their responses into parts (write_column_part), rank 0 merges them, so no
    two processes write one memory-mapped file (from several NFS clients, each writes back whole pages and can
    overwrite a neighbour's rows). NaN marks a response not yet computed, so a killed pass resumes where it stopped,
    whatever the number of ranks; `complete` is written (atomically, by rank 0) once every response is in."""

    def __init__(self, path, n_tokens, create, readonly=False):
        self.path, self.done_file = Path(path), Path(str(path) + ".complete")
        if create and not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
            np.full(n_tokens, np.nan, dtype="<f4").tofile(tmp)
            os.replace(tmp, self.path)
        mode = "r" if readonly or self.complete else "r+"
        self.values = np.memmap(self.path, dtype="<f4", mode=mode, shape=(n_tokens,))

    @property
    def complete(self):
        return self.done_file.exists()

    def missing(self, stage):
        """[n] bool: the responses whose values are not all there yet (one vectorized read)."""
        if stage.n == 0:
            return np.zeros(0, dtype=bool)
        return np.logical_or.reduceat(np.isnan(self.values), stage.token_offset[:-1])

    def put(self, stage, i, values):
        self.values[stage.token_offset[i]:stage.token_offset[i + 1]] = values

    def get(self, stage, i):
        return self.values[stage.token_offset[i]:stage.token_offset[i + 1]]

    def flush(self):
        if self.values.mode != "r":
            self.values.flush()

    def mark_complete(self, summary):
        self.flush()
        common.atomic_write_json(self.done_file, summary)

    def parts(self):
        """The parts a killed pass left (merged before the next pass starts)."""
        return sorted(self.path.parent.glob(f"{self.path.name}.part-r*.npz"))

    def merge_parts(self, stage, paths):
        """Rank 0: the parts' values into the column, then the parts deleted. Returns how many responses."""
        merged = 0
        for path in paths:
            with np.load(path) as part:
                indices, values = part["indices"], part["values"]
            lengths = stage.token_offset[indices + 1] - stage.token_offset[indices]
            if int(lengths.sum()) != len(values):
                raise RolloutError(f"{path}: {len(values)} values for responses of {int(lengths.sum())} tokens")
            for i, start in zip(indices, np.concatenate([[0], np.cumsum(lengths)[:-1]])):
                self.put(stage, i, values[start:start + stage.response_len[i]])
            merged += len(indices)
        self.flush()
        for path in paths:
            path.unlink()
        return merged
