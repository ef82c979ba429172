"""The manifest.json of a sharded corpus: dataclasses mirroring the file, a validating loader and a writer."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SPLITS",
    "DomainInfo",
    "InputInfo",
    "Manifest",
    "SplitStats",
    "load_manifest",
    "manifest_from_dict",
    "tokenizer_mismatch",
    "verify_output",
    "vocab_fingerprint",
    "write_manifest",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
_MODES = ("pretrain", "finetune")


@dataclass
class SplitStats:
    """One split of one domain.

    Attributes:
        records: Input records assigned to the split.
        samples: MDS samples written (pretrain: packed sequences; finetune: one per record).
        tokens: Tokens written (pretrain: `input_ids`; finetune: prompt plus response, EOS included).
    """

    records: int = 0
    samples: int = 0
    tokens: int = 0


@dataclass
class DomainInfo:
    """One domain: its name, MDS directory and counts.

    `input_records == splits["train"].records + splits["val"].records + rejected` always holds.

    Attributes:
        name: Domain name (after any domain mapping).
        dir: Filesystem-safe directory name under `train/` and `val/`.
        input_records: Records of this domain that passed the split filter.
        rejected: Records not written: bad input (with `on_error: skip`) and records the
            truncation policy drops (`too_long`).
        truncated: Records written after truncation (finetune).
        too_long: Records dropped by the truncation policy (a subset of `rejected`).
        splits: "train" and "val" statistics.
    """

    name: str
    dir: str
    input_records: int
    rejected: int
    truncated: int
    splits: dict[str, SplitStats]
    too_long: int = 0


@dataclass
class InputInfo:
    """One input file: its path as given, sha256 of its bytes (None for hub datasets), records read.

    `split` is "val" for a file whose records all went to the validation split (`--val-file`),
    None when the validation rule split its records.
    """

    path: str
    sha256: str | None
    records: int
    split: str | None = None


@dataclass
class Manifest:
    """A sharded corpus: `OUT/manifest.json`, with `OUT/<split>/<domain dir>/` MDS directories.

    The domain id used in training is the position in `domains`, which is sorted by name.
    `root` is where the manifest was loaded from (not stored in the file).

    Attributes:
        format_version: Always `FORMAT_VERSION`.
        mode: "pretrain" (column `input_ids`) or "finetune" (`prompt_ids`, `response_ids`, `record`).
        tokenizer: The tokenizer name or path as given.
        vocab_size, eos_token_id, pad_token_id, bos_token_id: From the tokenizer.
        max_seq_len: Sequence length (pretrain: every sample but a domain split's last; finetune: the cap).
        prompt_template: Template name or string (finetune), else None.
        truncation: Truncation policy (finetune), else None.
        val_fraction, val_count: The validation split rule (at most one is set).
        seed: Seed of the validation split.
        domains: Per-domain information, sorted by name.
        inputs: The input files.
        command: The command line that produced it.
        created: ISO 8601 creation time.
        source_format: The corpus format ("dolma", "metamathqa", "mol", "jsonl").
        rejected_other: Rejected records not counted under any domain in `domains` (no
            readable domain, or a domain with nothing written).
        filtered_out: Records excluded by the split filter (`split_filter`).
        split_filter: The split label kept (e.g. "train"), or None.
        vocab_sha256: `vocab_fingerprint` of the tokenizer over its `vocab_size` ids, or None (shards written
            before it was recorded).
        root: The directory the manifest belongs to.
    """

    format_version: int
    mode: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int
    pad_token_id: int | None
    bos_token_id: int | None
    max_seq_len: int
    prompt_template: str | None
    truncation: str | None
    val_fraction: float | None
    val_count: int | None
    seed: int
    domains: list[DomainInfo]
    inputs: list[InputInfo]
    command: str
    created: str
    source_format: str | None = None
    rejected_other: int = 0
    filtered_out: int = 0
    split_filter: str | None = None
    vocab_sha256: str | None = None
    root: Path | None = field(default=None, compare=False)

    @property
    def domain_names(self) -> list[str]:
        """Domain names in id order."""
        return [d.name for d in self.domains]

    def domain_index(self, name: str) -> int:
        """The domain id of `name`.

        Raises:
            KeyError: If the manifest has no such domain.
        """
        for i, d in enumerate(self.domains):
            if d.name == name:
                return i
        raise KeyError(f"domain {name!r} not in the manifest; domains: {self.domain_names}")

    def split_dir(self, domain: str | int, split: str) -> Path:
        """The MDS directory of a domain (name or id) and split, under `root`.

        Raises:
            ValueError: If the manifest was not loaded from disk or `split` is unknown.
        """
        if self.root is None:
            raise ValueError("manifest has no `root`; load it with load_manifest(dir)")
        if split not in SPLITS:
            raise ValueError(f"`split` must be one of {list(SPLITS)}, got {split!r}")
        info = self.domains[domain if isinstance(domain, int) else self.domain_index(domain)]
        return self.root / split / info.dir

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to manifest.json (without `root`)."""
        out = asdict(self)
        out.pop("root")
        return out


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate `manifest.json` from a sharded corpus directory (or the file itself).

    Args:
        path: The output directory of tools/shard.py, or its manifest.json.

    Returns:
        The manifest, with `root` set to the directory.

    Raises:
        ValueError: If the file is missing or not JSON, or a field is missing, has the wrong
            type or an invalid value, or the counts do not reconcile; the message names the
            file and the field.
    """
    path = Path(path)
    file = path / MANIFEST_NAME if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{file}: no manifest (is {path} the output directory of tools/shard.py?)")
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from exc
    manifest = manifest_from_dict(obj, source=str(file))
    manifest.root = file.parent
    return manifest


def manifest_from_dict(obj: Any, source: str = "manifest") -> Manifest:
    """Validate a manifest JSON object and convert it (see `load_manifest`).

    Args:
        obj: The decoded JSON.
        source: Name used in error messages.

    Returns:
        The manifest (`root` unset).

    Raises:
        ValueError: As `load_manifest`, listing every problem found.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    fields = _FieldReader()
    get, problems = fields.get, fields.problems

    version = get(obj, "format_version", (int,), "")
    if version is not None and version != FORMAT_VERSION:
        problems.append(f"field `format_version` must be {FORMAT_VERSION}, got {version!r}")
    mode = get(obj, "mode", (str,), "")
    if mode is not None and mode not in _MODES:
        problems.append(f"field `mode` must be one of {list(_MODES)}, got {mode!r}")
    max_seq_len = get(obj, "max_seq_len", (int,), "")
    if max_seq_len is not None and max_seq_len < 1:
        problems.append(f"field `max_seq_len` must be >= 1, got {max_seq_len}")
    val_fraction = get(obj, "val_fraction", (int, float), "", optional=True)
    val_count = get(obj, "val_count", (int,), "", optional=True)
    if val_fraction is not None and val_count is not None:
        problems.append(f"fields `val_fraction` ({val_fraction}) and `val_count` ({val_count}) are mutually exclusive")

    domains = _domains_from_json(get(obj, "domains", (list,), "") or [], fields)
    inputs = _inputs_from_json(get(obj, "inputs", (list,), "") or [], fields)

    manifest = Manifest(
        format_version=version,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        tokenizer=get(obj, "tokenizer", (str,), ""),
        vocab_size=get(obj, "vocab_size", (int,), ""),
        eos_token_id=get(obj, "eos_token_id", (int,), ""),
        pad_token_id=get(obj, "pad_token_id", (int,), "", optional=True),
        bos_token_id=get(obj, "bos_token_id", (int,), "", optional=True),
        max_seq_len=max_seq_len,  # type: ignore[arg-type]
        prompt_template=get(obj, "prompt_template", (str,), "", optional=True),
        truncation=get(obj, "truncation", (str,), "", optional=True),
        val_fraction=val_fraction,
        val_count=val_count,
        seed=get(obj, "seed", (int,), ""),
        domains=domains,
        inputs=inputs,
        command=get(obj, "command", (str,), ""),
        created=get(obj, "created", (str,), ""),
        source_format=get(obj, "source_format", (str,), "", optional=True),
        rejected_other=get(obj, "rejected_other", (int,), "", optional=True) or 0,
        filtered_out=get(obj, "filtered_out", (int,), "", optional=True) or 0,
        split_filter=get(obj, "split_filter", (str,), "", optional=True),
        vocab_sha256=get(obj, "vocab_sha256", (str,), "", optional=True),
    )
    if not problems and inputs:
        read = sum(i.records for i in inputs)
        accounted = sum(d.input_records for d in domains) + manifest.rejected_other + manifest.filtered_out
        if read != accounted:
            problems.append(
                f"records do not reconcile: inputs hold {read}, domains + rejected_other + filtered_out account for {accounted}"
            )
    if problems:
        raise ValueError(f"{source}: invalid manifest:\n  " + "\n  ".join(problems))
    return manifest


def vocab_fingerprint(tokenizer: Any, size: int) -> str:
    """sha256 of the tokens `tokenizer` gives ids 0 .. size-1, one a line: what the ids of shards mean."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    return hashlib.sha256("\n".join(str(t) for t in tokens).encode("utf-8")).hexdigest()


def tokenizer_mismatch(manifest: Manifest, tokenizer: Any, name: str, *, field: str = "tokenizer_name") -> str | None:
    """Why `tokenizer` (named `name` by `field`) cannot read the shards of `manifest`, or None when it can.

    The shards hold token ids of the tokenizer they were written with. A run with another one fails inside the
    embedding (an id past the model's vocabulary: "index out of range"), or, when the ids happen to fit, trains
    and evaluates on text it reads as something else. With the shards' `vocab_sha256`, `tokenizer` must give
    their ids the same tokens (`vocab_fingerprint` over the shards' `vocab_size`): a base model's and its
    instruct model's tokenizer, which differ in their EOS only, read the same shards, and so does a tokenizer
    with tokens added after the shards' (a GGUF file's padded vocabulary). Shards written before the
    fingerprint was recorded compare the vocabulary size alone. The tokenizer the manifest names is not loaded:
    its path may be another machine's.
    """
    size = len(tokenizer)
    if manifest.vocab_sha256 is None:
        if size == manifest.vocab_size:
            return None
        why = f"vocabulary {size}, the shards' {manifest.vocab_size}"
    elif size >= manifest.vocab_size and vocab_fingerprint(tokenizer, manifest.vocab_size) == manifest.vocab_sha256:
        return None
    elif size < manifest.vocab_size:
        why = f"vocabulary {size}, smaller than the shards' {manifest.vocab_size}"
    else:
        why = f"its ids 0-{manifest.vocab_size - 1} are other tokens than the shards'"
    return (
        f"{field} {name!r} is not the tokenizer the shards in {manifest.root} were written with "
        f"({manifest.tokenizer!r}): {why}; use that one, or re-shard with tools/shard.py --tokenizer {name}"
    )


def write_manifest(manifest: Manifest, directory: str | Path) -> Path:
    """Write `manifest.json` into `directory` (pretty-printed, keys in dataclass order).

    Args:
        manifest: The manifest; it is validated first.
        directory: Where to write.

    Returns:
        The file written.

    Raises:
        ValueError: If the manifest does not validate.
    """
    obj = manifest.to_dict()
    manifest_from_dict(obj, source="manifest to write")
    file = Path(directory) / MANIFEST_NAME
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return file


def verify_output(path: str | Path, check_inputs: bool = False) -> list[str]:
    """Check a sharded corpus against its manifest: files, hashes, sample and token counts.

    For every domain and split: the MDS index exists and lists only the expected columns;
    each shard file has the recorded size, sha1 and xxh64 (compressed and decompressed);
    every sample decodes with Streaming's reader; token ids lie in `[0, vocab_size)`; pretrain
    samples are `max_seq_len` long except the last of a split, finetune samples fit in
    `max_seq_len` with a non-empty response; the sample and token totals match the manifest.
    Also: the manifest lists at least one domain with training samples (an output without data
    is a problem), no MDS directory is missing from or extra to the manifest, and
    `rejects.jsonl` holds one line per rejected record when it exists.

    Args:
        path: The output directory.
        check_inputs: Also re-hash the input files that still exist and compare with the manifest.

    Returns:
        The problems found; empty when the output is sound.
    """
    import tempfile

    from streaming.base.compression import decompress
    from streaming.base.format import reader_from_json
    from streaming.base.hashing import get_hash

    root = Path(path)
    try:
        manifest = load_manifest(root)
    except ValueError as exc:
        return [str(exc)]
    problems: list[str] = []
    if not any(d.splits["train"].samples > 0 for d in manifest.domains):
        problems.append(
            f"{root / MANIFEST_NAME}: no data: {len(manifest.domains)} domains and no training samples "
            "(were the inputs empty, or every record rejected?); re-shard with inputs that hold valid records"
        )
    columns = {"input_ids"} if manifest.mode == "pretrain" else {"prompt_ids", "response_ids", "record"}
    expected_dirs = {(split, d.dir) for d in manifest.domains for split in SPLITS if d.splits[split].samples > 0}
    for split in SPLITS:
        if (root / split).is_dir():
            for sub in (root / split).iterdir():
                if (split, sub.name) not in expected_dirs:
                    problems.append(f"{split}/{sub.name}: directory not in the manifest (or the manifest says it has no samples)")

    with tempfile.TemporaryDirectory() as scratch:
        for d in manifest.domains:
            for split in SPLITS:
                if d.splits[split].samples == 0:
                    continue
                _check_split(manifest, root, d, split, columns, Path(scratch), problems, reader_from_json, decompress, get_hash)

    _check_rejects(root, manifest, problems)
    if check_inputs:
        _check_inputs(manifest, problems)
    return problems


def _check_split(
    manifest: Manifest,
    root: Path,
    d: DomainInfo,
    split: str,
    columns: set[str],
    scratch: Path,
    problems: list[str],
    reader_from_json: Any,
    decompress: Any,
    get_hash: Any,
) -> None:
    """Check one domain's MDS directory of one split (index, shards, samples, totals); problems go to `problems`."""
    want = d.splits[split]
    where = f"{split}/{d.dir}"
    index_file = root / split / d.dir / "index.json"
    if not index_file.is_file():
        problems.append(f"{where}: missing index.json (manifest: {want.samples} samples)")
        return
    try:
        shards = json.loads(index_file.read_text())["shards"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        problems.append(f"{where}/index.json: unreadable ({exc})")
        return
    samples = tokens = 0
    for shard_idx, shard in enumerate(shards):
        names = set(shard.get("column_names", []))
        if names != columns:
            problems.append(f"{where}: shard {shard_idx} has columns {sorted(names)}, mode {manifest.mode} needs {sorted(columns)}")
            continue
        raw = _read_shard(root / split / d.dir, shard, where, problems, decompress, get_hash)
        if raw is None:
            continue
        local = scratch / f"{split}-{d.dir}-{shard_idx}"
        local.mkdir()
        (local / shard["raw_data"]["basename"]).write_bytes(raw)
        reader = reader_from_json(str(local), None, shard)
        for i in range(shard["samples"]):
            sample = reader.get_item(i)
            last = shard_idx == len(shards) - 1 and i == shard["samples"] - 1
            tokens += _check_sample(manifest, sample, last, f"{where}: shard {shard_idx} sample {i}", problems)
        samples += shard["samples"]
    if (samples, tokens) != (want.samples, want.tokens):
        problems.append(f"{where}: holds {samples} samples / {tokens} tokens, manifest says {want.samples} / {want.tokens}")
    if manifest.mode == "finetune" and samples != want.records:
        problems.append(f"{where}: {samples} samples but {want.records} records (finetune writes one sample per record)")


def _check_rejects(root: Path, manifest: Manifest, problems: list[str]) -> None:
    """When `rejects.jsonl` exists, check it holds one line per rejected record; problems go to `problems`."""
    rejects = root / "rejects.jsonl"
    if rejects.is_file():
        n_lines = sum(1 for line in rejects.open("rb") if line.strip())
        n_rejected = sum(d.rejected for d in manifest.domains) + manifest.rejected_other
        if n_lines != n_rejected:
            problems.append(f"rejects.jsonl: {n_lines} lines, manifest counts {n_rejected} rejected records")


def _check_inputs(manifest: Manifest, problems: list[str]) -> None:
    """Re-hash the input files that still exist and compare with the manifest; problems go to `problems`."""
    for inp in manifest.inputs:
        file = Path(inp.path)
        if inp.sha256 is None or not file.is_file():
            continue
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if digest != inp.sha256:
            problems.append(f"input {inp.path}: sha256 {digest[:12]}... differs from the manifest's {inp.sha256[:12]}... (changed since sharding)")


def _read_shard(directory: Path, shard: dict, where: str, problems: list[str], decompress: Any, get_hash: Any) -> bytes | None:
    """The decompressed bytes of one shard after checking sizes and hashes; None (and a problem) if bad."""
    info = shard.get("zip_data") or shard["raw_data"]
    file = directory / info["basename"]
    if not file.is_file():
        problems.append(f"{where}/{info['basename']}: missing shard file")
        return None
    data = file.read_bytes()
    ok = True
    for label, meta, blob in (("file", info, data),):
        if len(blob) != meta["bytes"]:
            problems.append(f"{where}/{meta['basename']}: {len(blob)} bytes, index says {meta['bytes']}")
            ok = False
        for algo, value in meta.get("hashes", {}).items():
            if get_hash(algo, blob) != value:
                problems.append(f"{where}/{meta['basename']}: {label} {algo} mismatch")
                ok = False
    if not ok:
        return None
    raw = decompress(shard["compression"], data) if shard.get("zip_data") else data
    raw_info = shard["raw_data"]
    for algo, value in raw_info.get("hashes", {}).items():
        if get_hash(algo, raw) != value:
            problems.append(f"{where}/{info['basename']}: decompressed {algo} mismatch")
            return None
    if len(raw) != raw_info["bytes"]:
        problems.append(f"{where}/{info['basename']}: decompressed to {len(raw)} bytes, index says {raw_info['bytes']}")
        return None
    return raw


def _check_sample(manifest: Manifest, sample: dict, last: bool, where: str, problems: list[str]) -> int:
    """Check one decoded sample; return its token count."""
    arrays = [sample["input_ids"]] if manifest.mode == "pretrain" else [sample["prompt_ids"], sample["response_ids"]]
    n = sum(len(a) for a in arrays)
    for a in arrays:
        if a.dtype != np.int32 or a.ndim != 1:
            problems.append(f"{where}: expected a 1-D int32 array, got {a.dtype} with shape {a.shape}")
        elif len(a) and (a.min() < 0 or a.max() >= manifest.vocab_size):
            problems.append(f"{where}: token ids outside [0, {manifest.vocab_size})")
    if manifest.mode == "pretrain":
        if n == 0 or (n != manifest.max_seq_len and not (last and n < manifest.max_seq_len)):
            problems.append(f"{where}: {n} tokens; every sample but a split's last must have max_seq_len {manifest.max_seq_len}")
    elif n > manifest.max_seq_len or len(arrays[1]) == 0:
        problems.append(f"{where}: prompt {len(arrays[0])} + response {len(arrays[1])} tokens (max_seq_len {manifest.max_seq_len}, response must be non-empty)")
    return n


class _FieldReader:
    """Reads typed fields out of decoded JSON objects, collecting one problem per missing or mistyped field."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def get(self, container: dict, key: str, types: tuple[type, ...], where: str, optional: bool = False) -> Any:
        """The value of `key` if present and of one of `types`; else None (and a problem, unless optional and absent)."""
        if key not in container:
            if not optional:
                self.problems.append(f"missing field `{where}{key}`")
            return None
        value = container[key]
        if value is None and optional:
            return None
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            self.problems.append(f"field `{where}{key}` must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
            return None
        return value


def _domains_from_json(raw_domains: list, fields: _FieldReader) -> list[DomainInfo]:
    """The `domains` entries that are objects, as `DomainInfo`; problems (order, duplicates) go to `fields`."""
    problems = fields.problems
    domains: list[DomainInfo] = []
    for i, d in enumerate(raw_domains):
        if not isinstance(d, dict):
            problems.append(f"field `domains[{i}]` must be an object")
            continue
        domains.append(_domain_from_json(d, f"domains[{i}].", fields))
    names = [d.name for d in domains]
    if all(isinstance(n, str) for n in names) and names != sorted(names):
        problems.append(f"field `domains` must be sorted by name, got {names}")
    if len(set(names)) != len(names) or len({d.dir for d in domains}) != len(domains):
        problems.append("field `domains` has duplicate names or dirs")
    return domains


def _domain_from_json(d: dict, where: str, fields: _FieldReader) -> DomainInfo:
    """One `domains[i]` object as `DomainInfo`, after checking its counts reconcile and its dir is plain."""
    get, problems = fields.get, fields.problems
    splits = _splits_from_json(get(d, "splits", (dict,), where) or {}, where, fields)
    info = DomainInfo(
        name=get(d, "name", (str,), where),
        dir=get(d, "dir", (str,), where),
        input_records=get(d, "input_records", (int,), where),
        rejected=get(d, "rejected", (int,), where),
        truncated=get(d, "truncated", (int,), where),
        too_long=get(d, "too_long", (int,), where, optional=True) or 0,
        splits=splits,
    )
    if len(splits) == len(SPLITS) and None not in (info.input_records, info.rejected):
        written = splits["train"].records + splits["val"].records
        if info.input_records != written + info.rejected:
            problems.append(
                f"domain {info.name!r}: `input_records` ({info.input_records}) != train.records + val.records + "
                f"rejected ({splits['train'].records} + {splits['val'].records} + {info.rejected})"
            )
    if info.dir is not None and (not info.dir or "/" in info.dir or info.dir in (".", "..")):
        problems.append(f"field `{where}dir` must be a plain directory name, got {info.dir!r}")
    return info


def _splits_from_json(raw_splits: dict, where: str, fields: _FieldReader) -> dict[str, SplitStats]:
    """The splits of one domain whose three counts are all present, as `SplitStats`."""
    splits: dict[str, SplitStats] = {}
    for split in SPLITS:
        s = raw_splits.get(split)
        if not isinstance(s, dict):
            fields.problems.append(f"field `{where}splits.{split}` must be an object with records, samples, tokens")
            continue
        values = [fields.get(s, k, (int,), f"{where}splits.{split}.") for k in ("records", "samples", "tokens")]
        if any(v is None for v in values):
            continue
        if any(v < 0 for v in values):
            fields.problems.append(f"field `{where}splits.{split}` has negative counts: {s}")
        splits[split] = SplitStats(*values)
    return splits


def _inputs_from_json(raw_inputs: list, fields: _FieldReader) -> list[InputInfo]:
    """The `inputs` entries that are objects, as `InputInfo`."""
    inputs: list[InputInfo] = []
    for i, inp in enumerate(raw_inputs):
        if not isinstance(inp, dict):
            fields.problems.append(f"field `inputs[{i}]` must be an object")
            continue
        where = f"inputs[{i}]."
        inputs.append(
            InputInfo(
                path=fields.get(inp, "path", (str,), where),
                sha256=fields.get(inp, "sha256", (str,), where, optional=True),
                records=fields.get(inp, "records", (int,), where),
                split=fields.get(inp, "split", (str,), where, optional=True),
            )
        )
    return inputs
