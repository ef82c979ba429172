"""Readers for Dolma, MetaMathQA, Mol-Instructions and generic JSON Lines corpora: files to raw records to parsed, domain-tagged records."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import io
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

logger = logging.getLogger(__name__)

__all__ = [
    "CORPUS_FORMATS",
    "SUPPORTED_SUFFIXES",
    "CorpusError",
    "CorpusSpec",
    "InputFile",
    "ParsedRecord",
    "RawRecord",
    "RecordError",
    "iter_raw_records",
    "list_input_files",
    "load_domain_map",
    "make_corpus_spec",
    "describe_json_error",
    "parse_record",
]

SUPPORTED_SUFFIXES = (".json.gz", ".jsonl.gz", ".json.zst", ".jsonl.zst", ".json", ".jsonl")
CORPUS_FORMATS = ("dolma", "metamathqa", "mol", "jsonl")
_DOMAIN_FROM = ("field", "source", "dir")
_WS = re.compile(r"[ \t\n\r]*")
_BOM = "\ufeff"


class CorpusError(ValueError):
    """A problem with an input file as a whole (unreadable, malformed JSON array); always fatal."""


class RecordError(ValueError):
    """A problem with one record (malformed JSON line, missing field, empty text, ...).

    Args:
        problem: What is wrong, e.g. "missing field 'text'".
        domain: The record's domain when it could be determined, else None.
        record: The parsed record, the raw line text, or (invalid UTF-8) the raw line bytes, for the
            rejects file.
    """

    def __init__(self, problem: str, domain: str | None = None, record: Any = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.domain = domain
        self.record = record


@dataclass(frozen=True)
class CorpusSpec:
    """How to read one corpus format into domain-tagged records.

    Field names are dotted paths into the record (`metadata.task`). A pretraining format sets
    `text_field`; an instruction format sets `prompt_field` and `response_field` (and optionally
    `input_field`, Mol-Instructions' context). Build one with `make_corpus_spec`.

    Args:
        format: One of `CORPUS_FORMATS`.
        domain_from: "field" (the `domain_field` value) or "dir" (the directory the file is in,
            or for a Dolma tree `documents/<source>/...` the `<source>` directory).
        domain_field: Dotted path of the domain field.
        domain_map: Optional raw domain -> domain name mapping (merges or renames); with a
            mapping every domain must be mapped, and the key "*" maps all others.
        domain_map_source: Where the mapping came from, for error messages.
        text_field: Dotted path of the text (pretraining formats).
        prompt_field: Dotted path of the instruction or question.
        input_field: Dotted path of an optional context field ("" when missing or null).
        response_field: Dotted path of the response.
        split_field: Dotted path of the record's split label, or None.
        split: Keep only records whose split label equals this; None keeps all. Records without
            a split label are kept.
    """

    format: str
    domain_from: str = "field"
    domain_field: str | None = None
    domain_map: dict[str, str] | None = None
    domain_map_source: str | None = None
    text_field: str | None = None
    prompt_field: str | None = None
    input_field: str | None = None
    response_field: str | None = None
    split_field: str | None = None
    split: str | None = None

    @property
    def is_instruction(self) -> bool:
        """Whether records are (prompt, response) pairs rather than plain text."""
        return self.response_field is not None

    @property
    def default_mode(self) -> str:
        """"finetune" for instruction formats, "pretrain" otherwise."""
        return "finetune" if self.is_instruction else "pretrain"


@dataclass(frozen=True)
class InputFile:
    """One input: a file on disk or a hub dataset.

    Args:
        path: The file path as found (or the hub dataset name).
        display: Short name used in errors and provenance (relative to the given directory).
        dir_domain: The domain implied by the file's directory (see `CorpusSpec.domain_from`).
        hub_split: For a hub dataset, the split to load; None for files.
        split: "val" for a file whose records all form the validation split (`--val-file`);
            None when each record's split is decided by the validation rule.
    """

    path: str
    display: str
    dir_domain: str
    hub_split: str | None = None
    split: str | None = None


@dataclass(frozen=True)
class RawRecord:
    """One unparsed record: a JSON Lines line (bytes) or a decoded JSON array element.

    Args:
        line: 1-based line number where the record starts.
        loc: Provenance position: the line number for JSON Lines, the 0-based index for arrays.
        payload: The line's bytes (JSON Lines) or the decoded element (arrays, hub rows).
        element: The 0-based element index in a JSON array (or hub dataset row), else None.
    """

    line: int
    loc: int
    payload: Any
    element: int | None = None

    def where(self, display: str) -> str:
        """`file:line`, plus the element index for array records (a MetaMathQA file is one line)."""
        return f"{display}:{self.line}" if self.element is None else f"{display}:{self.line}: element {self.element}"


@dataclass(frozen=True)
class ParsedRecord:
    """A validated record: its (mapped) domain, split label, and text or prompt parts."""

    domain: str
    split: str | None
    text: str = ""
    instruction: str = ""
    input: str = ""
    response: str = ""
    obj: Any = None


def make_corpus_spec(
    format: str,  # noqa: A002 - the CLI's word for it
    *,
    domain_from: str = "field",
    domain_map: dict[str, str] | None = None,
    domain_map_source: str | None = None,
    split: str | None = "train",
    text_field: str | None = None,
    prompt_field: str | None = None,
    input_field: str | None = None,
    response_field: str | None = None,
    domain_field: str | None = None,
    split_field: str | None = None,
) -> CorpusSpec:
    """Build the `CorpusSpec` of a named format, with optional overrides.

    Defaults per format: `dolma` reads `text`, domain `source`; `metamathqa` reads `query` ->
    `response`, domain `type`; `mol` reads `instruction` + `input` -> `output`, domain
    `metadata.task`, split `metadata.split`; `jsonl` reads `text` (or `prompt` -> `response`
    when `response_field` is given), domain `domain`. "source" is accepted for `domain_from`
    as a synonym of "field".

    Args:
        format: One of `CORPUS_FORMATS`.
        domain_from: "field", "source" or "dir" (default "field").
        domain_map: Optional raw -> final domain names (see `CorpusSpec`).
        domain_map_source: Where the mapping came from, for messages.
        split: Split filter for formats with a split field (default "train"; None or "any"
            keeps all).
        text_field, prompt_field, input_field, response_field, domain_field, split_field:
            Override the format's field paths (`jsonl` mainly).

    Returns:
        The spec.

    Raises:
        ValueError: On an unknown format or `domain_from`, or a field combination that names
            neither a text nor a prompt/response pair.
    """
    if format not in CORPUS_FORMATS:
        raise ValueError(f"corpus `format` must be one of {list(CORPUS_FORMATS)}, got {format!r}")
    if domain_from not in _DOMAIN_FROM:
        raise ValueError(f"`domain_from` must be one of {list(_DOMAIN_FROM)}, got {domain_from!r}")
    overrides = {
        "text_field": text_field,
        "prompt_field": prompt_field,
        "input_field": input_field,
        "response_field": response_field,
        "domain_field": domain_field,
        "split_field": split_field,
    }
    fields = _format_fields(format, overrides)
    if fields.get("response_field") is not None and fields.get("text_field") is not None:
        raise ValueError(
            f"corpus `{format}`: give either a text field ({fields['text_field']!r}) or a prompt/response pair "
            f"({fields.get('prompt_field')!r} -> {fields['response_field']!r}), not both"
        )
    if fields.get("response_field") is not None and fields.get("prompt_field") is None:
        raise ValueError(f"corpus `{format}`: `response_field` {fields['response_field']!r} needs a `prompt_field`")
    if domain_map is not None:
        _check_domain_map(domain_map, domain_map_source or "domain_map")
    return CorpusSpec(
        format=format,
        domain_from="dir" if domain_from == "dir" else "field",
        domain_map=domain_map,
        domain_map_source=domain_map_source,
        split=None if split in (None, "any") else split,
        **fields,
    )


def load_domain_map(path: str | Path) -> dict[str, str]:
    """Read a domain mapping (raw name -> domain name) from a JSON or YAML file.

    Several raw names may map to one domain (merge); the key "*" maps every other name.

    Args:
        path: A `.json`, `.yaml` or `.yml` file holding one mapping of strings to strings.

    Returns:
        The mapping.

    Raises:
        ValueError: If the file is missing, unparsable, or not a mapping of non-empty strings.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"`domain_map` file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            mapping = yaml.safe_load(text)
        else:
            mapping = json.loads(text)
    except Exception as exc:  # yaml and json raise different types; both mean a bad file
        raise ValueError(f"`domain_map` file {str(path)!r} could not be parsed: {exc}") from exc
    _check_domain_map(mapping, str(path))
    return mapping


def list_input_files(inputs: list[str | Path], allow_hub: bool = False) -> list[InputFile]:
    """Expand the inputs into files: directories are searched recursively for supported files.

    Files are returned in sorted order within each input, inputs in the order given; the same
    file given twice is kept once.

    Args:
        inputs: Files, directories, or (with `allow_hub`) hub dataset names like `meta-math/MetaMathQA`.
        allow_hub: Treat an input that is not a path but looks like `owner/name` as a hub dataset.

    Returns:
        The input files.

    Raises:
        ValueError: If an input does not exist, a file has an unsupported suffix, or nothing is found.
    """
    found: list[InputFile] = []
    seen: set[Path] = set()
    for given in inputs:
        root = Path(given)
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and _has_supported_suffix(p.name))
            if not files:
                raise ValueError(f"input directory {str(root)!r} holds no files ending in {list(SUPPORTED_SUFFIXES)}")
            for path in files:
                display = str(Path(root.name) / path.relative_to(root))
                _append_unique(found, seen, path, display, _dir_domain(path))
        elif root.is_file():
            if not _has_supported_suffix(root.name):
                raise ValueError(f"input file {str(root)!r} must end in one of {list(SUPPORTED_SUFFIXES)}")
            _append_unique(found, seen, root, root.name, _dir_domain(root))
        elif allow_hub and re.fullmatch(r"[\w.-]+/[\w.-]+", str(given)):
            found.append(InputFile(path=str(given), display=str(given), dir_domain=str(given).split("/")[-1], hub_split="train"))
        else:
            raise ValueError(f"input {str(given)!r} does not exist (give files or directories{', or a hub dataset name' if allow_hub else ''})")
    counts = collections.Counter(f.display for f in found)
    # Provenance must be unambiguous: files that share a short name are named by their full path.
    return [f if counts[f.display] == 1 else dataclasses.replace(f, display=f.path) for f in found]


def iter_raw_records(file: InputFile) -> Iterator[RawRecord]:
    """Yield the records of one input in file order.

    JSON Lines and JSON arrays are told apart by the first non-blank character ('[' means an
    array), so `.json.gz` files that hold JSON Lines are read correctly. Lines are split on
    b"\\n" only: text may contain U+2028/U+2029, which `str.splitlines` would split on. Blank
    lines are not records.

    Args:
        file: The input.

    Yields:
        Raw records. JSON Lines payloads are bytes (decoded and parsed later, per record, so a
        bad line is reported and skippable); array elements are already decoded.

    Raises:
        CorpusError: If the file cannot be read or decompressed, or a JSON array is malformed
            or not valid UTF-8 (array files are parsed as a whole, so these are fatal).
    """
    if file.hub_split is not None:
        yield from _iter_hub(file)
        return
    try:
        with _open_binary(file.path) as stream:
            head = stream.peek(4096)[:4096]
            if head.lstrip(b" \t\r\n").lstrip(_BOM.encode()).lstrip(b" \t\r\n").startswith(b"["):
                yield from _iter_json_array(file, stream.read())
                return
            for line_no, raw in enumerate(stream, start=1):
                if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                if not raw.strip():
                    continue
                yield RawRecord(line=line_no, loc=line_no, payload=raw.rstrip(b"\r\n"))
    except (OSError, EOFError, zstandard.ZstdError) as exc:
        raise CorpusError(f"{file.display}: cannot read ({type(exc).__name__}: {exc})") from exc


def parse_record(spec: CorpusSpec, raw: RawRecord, dir_domain: str) -> ParsedRecord | None:
    """Decode, validate and domain-tag one record.

    Args:
        spec: The corpus spec.
        raw: The raw record.
        dir_domain: The domain implied by the record's file location.

    Returns:
        The parsed record, or None when the split filter excludes it.

    Raises:
        RecordError: Invalid UTF-8, malformed JSON, not an object, a missing or non-string
            field, a field holding a lone surrogate (`"\\ud800"` is valid JSON but not text),
            empty text, or an unmapped domain.
    """
    obj = raw.payload
    if isinstance(obj, bytes):
        try:
            line = obj.decode("utf-8")
        except UnicodeDecodeError as exc:
            # The record is the raw bytes: the rejects file keeps them (base64) beside a readable form.
            raise RecordError(f"invalid UTF-8 at byte {exc.start} of the line", _domain_if_dir(spec, dir_domain), obj) from None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"malformed JSON ({describe_json_error(exc)})", _domain_if_dir(spec, dir_domain), line) from None
    if not isinstance(obj, dict):
        raise RecordError(f"record is a JSON {type(obj).__name__}, expected an object", _domain_if_dir(spec, dir_domain), obj)

    if spec.domain_from == "dir":
        raw_domain = dir_domain
    else:
        assert spec.domain_field is not None
        raw_domain = _get_str(obj, spec.domain_field, None, required=True)
        if not raw_domain.strip():
            raise RecordError(f"empty domain in field {spec.domain_field!r}", None, obj)
    domain = _map_domain(spec, raw_domain, obj)

    split_label = None
    if spec.split_field is not None:
        value = _get(obj, spec.split_field)
        split_label = value if isinstance(value, str) else None
        if spec.split is not None and split_label is not None and split_label != spec.split:
            return None

    if spec.is_instruction:
        assert spec.prompt_field is not None and spec.response_field is not None
        instruction = _get_str(obj, spec.prompt_field, domain, required=True)
        inp = _get_str(obj, spec.input_field, domain, required=False) if spec.input_field else ""
        response = _get_str(obj, spec.response_field, domain, required=True)
        for name, value in ((spec.prompt_field, instruction), (spec.response_field, response)):
            if not value.strip():
                raise RecordError(f"empty text in field {name!r}", domain, obj)
        return ParsedRecord(domain=domain, split=split_label, instruction=instruction, input=inp, response=response, obj=obj)
    assert spec.text_field is not None
    text = _get_str(obj, spec.text_field, domain, required=True)
    if not text.strip():
        raise RecordError(f"empty text in field {spec.text_field!r}", domain, obj)
    return ParsedRecord(domain=domain, split=split_label, text=text, obj=obj)


def describe_json_error(exc: json.JSONDecodeError) -> str:
    """`json`'s message with its column: "Expecting value at column 3", "Unterminated string starting at column 9"."""
    # Some of json's messages end in "at" and expect the position to follow.
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


# ---------------------------------------------------------------------------------------------


def _has_supported_suffix(name: str) -> bool:
    return name.endswith(SUPPORTED_SUFFIXES)


def _append_unique(found: list[InputFile], seen: set[Path], path: Path, display: str, dir_domain: str) -> None:
    key = path.resolve()
    if key not in seen:
        seen.add(key)
        found.append(InputFile(path=str(path), display=display, dir_domain=dir_domain))


def _dir_domain(path: Path) -> str:
    """The `<source>` of `.../documents/<source>/.../file`, else the file's directory name."""
    parents = path.resolve().parent.parts
    if "documents" in parents[:-1]:
        last = len(parents) - 1 - parents[::-1].index("documents")
        if last + 1 < len(parents):
            return parents[last + 1]
    return path.resolve().parent.name


def _open_binary(path: str) -> io.BufferedReader:
    if path.endswith(".gz"):
        return io.BufferedReader(gzip.GzipFile(path, "rb"))  # type: ignore[arg-type]
    if path.endswith(".zst"):
        raw = open(path, "rb")  # noqa: SIM115 - closed by the stream reader
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))  # type: ignore[arg-type]
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


def _iter_json_array(file: InputFile, data: bytes) -> Iterator[RawRecord]:
    """Decode a JSON array element by element, tracking the line each element starts on."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise CorpusError(f"{file.display}:{line}: invalid UTF-8 in a JSON array file (byte {exc.start}); the whole file is unreadable") from None
    decoder = json.JSONDecoder()
    cursor = [0, 1]  # (position, line at that position), advanced monotonically

    def line_at(pos: int) -> int:
        cursor[1] += text.count("\n", cursor[0], pos)
        cursor[0] = pos
        return cursor[1]

    pos = _WS.match(text, len(_BOM) if text.startswith(_BOM) else 0).end()
    if text[pos : pos + 1] != "[":
        raise CorpusError(f"{file.display}:{line_at(pos)}: expected a JSON array")
    pos = _WS.match(text, pos + 1).end()
    if text[pos : pos + 1] == "]":
        pos = _WS.match(text, pos + 1).end()
    else:
        index = 0
        while True:
            try:
                element, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise CorpusError(
                    f"{file.display}:{exc.lineno}: malformed JSON in array element {index} ({describe_json_error(exc)}); a JSON "
                    "array cannot be read past an error, even with --on-error skip: fix or remove the file"
                ) from None
            yield RawRecord(line=line_at(pos), loc=index, payload=element, element=index)
            index += 1
            pos = _WS.match(text, end).end()
            sep = text[pos : pos + 1]
            if sep == "]":
                pos = _WS.match(text, pos + 1).end()
                break
            if not sep:
                raise CorpusError(f"{file.display}:{line_at(pos)}: malformed JSON array: unexpected end of file after element {index - 1}")
            if sep != ",":
                raise CorpusError(f"{file.display}:{line_at(pos)}: malformed JSON array: expected ',' or ']' after element {index - 1}")
            pos = _WS.match(text, pos + 1).end()
    if pos < len(text):
        raise CorpusError(f"{file.display}:{line_at(pos)}: unexpected data after the JSON array")


def _iter_hub(file: InputFile) -> Iterator[RawRecord]:
    try:
        import datasets

        dataset = datasets.load_dataset(file.path, split=file.hub_split)
    except Exception as exc:  # offline, unknown name, gated: all mean the same to the user
        raise CorpusError(f"{file.display}: hub dataset could not be loaded ({type(exc).__name__}: {exc})") from exc
    for index, row in enumerate(dataset):
        yield RawRecord(line=index + 1, loc=index, payload=dict(row), element=index)  # type: ignore[arg-type]


def _format_fields(corpus_format: str, overrides: dict[str, str | None]) -> dict[str, Any]:
    """The field paths of a format: its defaults with the non-None `overrides` on top (jsonl: text or prompt/response)."""
    defaults: dict[str, Any] = {
        "dolma": {"text_field": "text", "domain_field": "source"},
        "metamathqa": {"prompt_field": "query", "response_field": "response", "domain_field": "type"},
        "mol": {
            "prompt_field": "instruction",
            "input_field": "input",
            "response_field": "output",
            "domain_field": "metadata.task",
            "split_field": "metadata.split",
        },
        "jsonl": {"domain_field": "domain"},
    }[corpus_format]
    fields = {**defaults, **{k: v for k, v in overrides.items() if v is not None}}
    if corpus_format == "jsonl":
        if fields.get("response_field") is not None or fields.get("prompt_field") is not None:
            fields.setdefault("prompt_field", "prompt")
            fields.setdefault("response_field", "response")
        else:
            fields.setdefault("text_field", "text")
    return fields


def _check_domain_map(mapping: Any, source: str) -> None:
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"`domain_map` ({source}) must be a non-empty mapping of raw domain -> domain name, got {type(mapping).__name__}")
    bad = {k: v for k, v in mapping.items() if not (isinstance(k, str) and isinstance(v, str) and k and v.strip())}
    if bad:
        raise ValueError(f"`domain_map` ({source}) must map non-empty strings to non-empty strings; bad entries: {bad}")


def _map_domain(spec: CorpusSpec, raw_domain: str, obj: Any) -> str:
    if spec.domain_map is None:
        return raw_domain
    mapped = spec.domain_map.get(raw_domain, spec.domain_map.get("*"))
    if mapped is None:
        raise RecordError(
            f"unmapped domain {raw_domain!r} (not in the domain map {spec.domain_map_source or ''}; add it or a '*' entry)", None, obj
        )
    return mapped


def _domain_if_dir(spec: CorpusSpec, dir_domain: str) -> str | None:
    """The record's domain when it does not depend on the record's content."""
    if spec.domain_from != "dir":
        return None
    if spec.domain_map is None:
        return dir_domain
    return spec.domain_map.get(dir_domain, spec.domain_map.get("*"))


_MISSING = object()


def _get(obj: dict, path: str) -> Any:
    value: Any = obj
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _get_str(obj: dict, path: str, domain: str | None, required: bool) -> str:
    value = _get(obj, path)
    if value is _MISSING or value is None:
        if required:
            raise RecordError(f"missing field {path!r}", domain, obj)
        return ""
    if not isinstance(value, str):
        raise RecordError(f"field {path!r} must be a string, got {type(value).__name__} {str(value)[:40]!r}", domain, obj)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # JSON's "\ud800" escapes decode to half a surrogate pair, which no tokenizer or UTF-8 file accepts.
        raise RecordError(
            f"field {path!r} holds a lone surrogate {value[exc.start]!r} at character {exc.start}: not valid Unicode text",
            domain,
            obj,
        ) from None
    return value
