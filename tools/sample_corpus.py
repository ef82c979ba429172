"""Generates a small, synthetic multi-domain corpus in the Dolma, MetaMathQA and Mol-Instructions formats."""

from __future__ import annotations

import gzip
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "DOLMA_SOURCE_DOCS",
    "METAMATH_TYPE_SHARES",
    "MOL_TASK_SHARES",
    "SampleCorpusSummary",
    "generate_dolma_documents",
    "generate_metamathqa",
    "generate_mol_instructions",
    "write_sample_corpus",
]

# Documents per Dolma-style source at scale 1.0. Sizes differ by more than 10x on purpose, and
# `spam` is the low-quality source that data selection should learn to avoid.
DOLMA_SOURCE_DOCS: dict[str, int] = {
    "common-crawl": 2400,
    "wiki": 1000,
    "stackexchange": 600,
    "reddit": 700,
    "spam": 150,
}
_DOCS_PER_FILE = 400

# The paper's figure of MetaMathQA's type shares (they sum to 100).
METAMATH_TYPE_SHARES: dict[str, float] = {
    "GSM_AnsAug": 20.3,
    "GSM_Rephrased": 20.3,
    "MATH_AnsAug": 18.9,
    "MATH_Rephrased": 12.7,
    "GSM_FOBAR": 10.1,
    "GSM_SV": 10.1,
    "MATH_FOBAR": 3.8,
    "MATH_SV": 3.8,
}
_METAMATH_RECORDS = 2400

# The four molecule tasks the paper uses, with Mol-Instructions' approximate shares.
MOL_TASK_SHARES: dict[str, float] = {
    "description_guided_molecule_design": 43.9,
    "forward_reaction_prediction": 18.5,
    "reagent_prediction": 18.5,
    "retrosynthesis": 19.1,
}
_MOL_RECORDS = 1600
_MOL_TEST_FRACTION = 0.1


@dataclass
class SampleCorpusSummary:
    """What `write_sample_corpus` wrote.

    Attributes:
        root: The output directory.
        dolma_docs: Documents per Dolma source.
        metamath_records: Records per MetaMathQA type.
        mol_records: Records per Mol-Instructions task (train and test together).
        files: Every file written, relative to `root`.
    """

    root: Path
    dolma_docs: dict[str, int] = field(default_factory=dict)
    metamath_records: dict[str, int] = field(default_factory=dict)
    mol_records: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def write_sample_corpus(out_dir: str | Path, seed: int = 0, scale: float = 1.0) -> SampleCorpusSummary:
    """Write the synthetic corpus in the three real on-disk layouts.

    Layout: `dolma/documents/<source>/<source>-NNNN.json.gz` (gzipped JSON Lines),
    `metamathqa/MetaMathQA-sample.json` (a JSON array) and `mol_instructions/<task>.json`
    (one JSON array per task). The output is byte-identical for the same `seed` and `scale`.

    Args:
        out_dir: Directory to create or fill (existing files with the same names are replaced).
        seed: Random seed (default 0).
        scale: Multiplies every record count (default 1.0, about 1M Dolma tokens in total).

    Returns:
        A `SampleCorpusSummary` with per-domain counts and the files written.

    Raises:
        ValueError: If `scale` is not positive.
    """
    if not scale > 0:
        raise ValueError(f"`scale` must be > 0, got {scale!r}")
    root = Path(out_dir)
    summary = SampleCorpusSummary(root=root)

    for source, docs in generate_dolma_documents(seed, scale).items():
        summary.dolma_docs[source] = len(docs)
        source_dir = root / "dolma" / "documents" / source
        source_dir.mkdir(parents=True, exist_ok=True)
        for file_idx, start in enumerate(range(0, len(docs), _DOCS_PER_FILE)):
            lines = [json.dumps(doc, ensure_ascii=False) for doc in docs[start : start + _DOCS_PER_FILE]]
            path = source_dir / f"{source}-{file_idx:04d}.json.gz"
            # mtime=0 keeps the gzip header, hence the file, identical across runs.
            path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0))
            summary.files.append(str(path.relative_to(root)))

    records = generate_metamathqa(seed, scale)
    summary.metamath_records = {t: sum(rec["type"] == t for rec in records) for t in METAMATH_TYPE_SHARES}
    path = root / "metamathqa" / "MetaMathQA-sample.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")
    summary.files.append(str(path.relative_to(root)))

    for task, task_records in generate_mol_instructions(seed, scale).items():
        summary.mol_records[task] = len(task_records)
        path = root / "mol_instructions" / f"{task}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(task_records, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")
        summary.files.append(str(path.relative_to(root)))

    logger.info("wrote sample corpus to %s: %d files", root, len(summary.files))
    return summary


def generate_dolma_documents(seed: int = 0, scale: float = 1.0) -> dict[str, list[dict]]:
    """Generate Dolma-style documents (`id`, `text`, `source`, `added`, `created`, `metadata`).

    Args:
        seed: Random seed (default 0).
        scale: Multiplies the per-source document counts of `DOLMA_SOURCE_DOCS` (default 1.0).

    Returns:
        Source name -> documents, sources in `DOLMA_SOURCE_DOCS` order.
    """
    makers = {
        "common-crawl": _web_page,
        "wiki": _wiki_article,
        "stackexchange": _stackexchange_thread,
        "reddit": _reddit_thread,
        "spam": _spam_page,
    }
    out: dict[str, list[dict]] = {}
    for source, base_count in DOLMA_SOURCE_DOCS.items():
        rng = random.Random(f"{seed}/dolma/{source}")
        docs = []
        for i in range(max(1, round(base_count * scale))):
            text = makers[source](rng)
            year = rng.randint(2014, 2022)
            docs.append(
                {
                    "id": f"{source}-{seed}-{i:06d}",
                    "text": text,
                    "source": source,
                    "added": f"2023-0{rng.randint(1, 9)}-{rng.randint(10, 28)}T12:00:00.000Z",
                    "created": f"{year}-{rng.randint(10, 12)}-{rng.randint(10, 28)}T08:30:00Z",
                    "metadata": {"length": len(text), "synthetic": True},
                }
            )
        out[source] = docs
    return out


def generate_metamathqa(seed: int = 0, scale: float = 1.0) -> list[dict]:
    """Generate MetaMathQA-style records (`query`, `response`, `type`, `original_question`).

    Every response is worked from the template's numbers and ends with `The answer is: N`.
    Type counts follow `METAMATH_TYPE_SHARES` (largest-remainder rounding); records are
    interleaved in a seeded random order.

    Args:
        seed: Random seed (default 0).
        scale: Multiplies the total record count (default 1.0, 2400 records).

    Returns:
        The records.
    """
    rng = random.Random(f"{seed}/metamathqa")
    counts = _largest_remainder(METAMATH_TYPE_SHARES, max(len(METAMATH_TYPE_SHARES), round(_METAMATH_RECORDS * scale)))
    records = []
    for type_name, count in counts.items():
        records.extend(_metamath_record(type_name, rng) for _ in range(count))
    rng.shuffle(records)
    return records


def generate_mol_instructions(seed: int = 0, scale: float = 1.0) -> dict[str, list[dict]]:
    """Generate Mol-Instructions-style records (`instruction`, `input`, `output`, `metadata`).

    Molecules are SELFIES strings built from functional-group fragments (any sequence of
    SELFIES symbols decodes to a valid molecule); reactions follow a few fixed rules, so the
    tasks are learnable. About 10% of each task has `metadata.split == "test"`.

    Args:
        seed: Random seed (default 0).
        scale: Multiplies the total record count (default 1.0, 1600 records).

    Returns:
        Task name -> records, tasks in `MOL_TASK_SHARES` order.
    """
    counts = _largest_remainder(MOL_TASK_SHARES, max(2 * len(MOL_TASK_SHARES), round(_MOL_RECORDS * scale)))
    out: dict[str, list[dict]] = {}
    for task, count in counts.items():
        rng = random.Random(f"{seed}/mol/{task}")
        records = []
        for i in range(count):
            instruction, inp, output = _MOL_TASKS[task](rng)
            split = "test" if i % round(1 / _MOL_TEST_FRACTION) == 0 else "train"
            records.append({"instruction": instruction, "input": inp, "output": output, "metadata": {"task": task, "split": split}})
        out[task] = records
    return out


# ---------------------------------------------------------------------------------------------
# Shared helpers.


def _largest_remainder(shares: dict[str, float], total: int) -> dict[str, int]:
    """Integer counts proportional to `shares` that sum to `total` (largest remainder)."""
    weight = sum(shares.values())
    exact = {k: total * v / weight for k, v in shares.items()}
    counts = {k: int(x) for k, x in exact.items()}
    by_remainder = sorted(shares, key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def _pick(rng: random.Random, options: tuple[str, ...] | list[str]) -> str:
    return options[rng.randrange(len(options))]


# ---------------------------------------------------------------------------------------------
# Dolma-style sources.

_SYLLABLES = ("ka", "lo", "ren", "mar", "ti", "vel", "dor", "sa", "nu", "bri", "ost", "al", "fen", "gar", "hil", "mo", "ra", "ves", "tor", "en")
_COUNTRIES = ("Norland", "Estavia", "Caldria", "Merovy", "Tessaly", "Orvania", "Pellor", "Quintara")
_REGIONS = ("northern", "southern", "coastal", "eastern", "western", "upland", "central")
_PROFESSIONS = ("botanist", "engineer", "composer", "mathematician", "historian", "architect", "chemist", "painter")
_FIELDS = ("number theory", "river ecology", "choral music", "bridge design", "medieval trade", "organic synthesis", "glass painting", "soil chemistry")
_FAMILIES = ("Carabidae", "Orchidaceae", "Lamiaceae", "Noctuidae", "Cyprinidae", "Rosaceae")
_HABITATS = ("wet meadows", "pine forests", "rocky coasts", "mountain streams", "dry grasslands", "river deltas")
_INDUSTRIES = ("fishing", "wool weaving", "copper mining", "shipbuilding", "wine making", "timber", "salt production")


def _name(rng: random.Random, parts: int = 2) -> str:
    return "".join(_pick(rng, _SYLLABLES) for _ in range(parts)).capitalize()


def _town_sections(rng: random.Random) -> list[str]:
    town, river, country = _name(rng, 3), _name(rng), _pick(rng, _COUNTRIES)
    founded = rng.randint(900, 1850)
    pool = [
        "== History ==\n"
        f"{town} was first recorded in {founded} as a market settlement. During the following centuries the "
        f"town grew around {_pick(rng, _INDUSTRIES)} and {_pick(rng, _INDUSTRIES)}. A stone bridge over the "
        f"{river} was completed in {founded + rng.randint(20, 200)}, and the railway reached the town in "
        f"{rng.randint(1850, 1930)}. A fire in {rng.randint(1600, 1900)} destroyed much of the old centre, "
        "which was rebuilt in brick.",
        "== Geography ==\n"
        f"The town covers an area of {rng.randint(5, 180)} square kilometres at an elevation of "
        f"{rng.randint(2, 1400)} metres. The climate is {_pick(rng, ('temperate', 'oceanic', 'continental', 'alpine'))}, "
        f"with a mean annual rainfall of {rng.randint(300, 1600)} millimetres. The {river} floods in most springs.",
        "== Economy ==\n"
        f"Today the largest employers are {_pick(rng, _INDUSTRIES)} and a hospital with {rng.randint(80, 900)} beds. "
        f"Unemployment stood at {rng.randint(2, 14)} percent in {rng.randint(2005, 2021)}.",
        "== Culture ==\n"
        f"The town hosts an annual festival of {_pick(rng, _FIELDS)} every {_pick(rng, ('May', 'July', 'October'))}. "
        f"Its museum holds about {rng.randint(2, 60)} thousand objects, mostly related to {_pick(rng, _INDUSTRIES)}.",
        "== Transport ==\n"
        f"{town} is served by a station on the line to {_name(rng, 3)}, with trains every {rng.choice((15, 30, 60))} minutes. "
        f"The nearest airport is {rng.randint(20, 140)} kilometres away.",
    ]
    lead = (
        f"{town} is a town in the {_pick(rng, _REGIONS)} part of {country}. It lies on the {river} River, "
        f"about {rng.randint(5, 300)} kilometres from the capital. At the {rng.randint(1990, 2020)} census "
        f"the town had a population of {rng.randint(800, 250000):,}."
    )
    return [lead] + rng.sample(pool, rng.randint(2, len(pool)))


def _species_sections(rng: random.Random) -> list[str]:
    genus, epithet = _name(rng, 2), _name(rng, 2).lower()
    pool = [
        "== Description ==\n"
        f"Adults reach a length of {rng.randint(3, 90)} millimetres. The species was first described in "
        f"{rng.randint(1780, 1990)} by the {_pick(rng, _PROFESSIONS)} {_name(rng)} {_name(rng, 3)}. "
        f"It differs from related species by its {_pick(rng, ('darker', 'longer', 'narrower', 'spotted'))} "
        f"{_pick(rng, ('wings', 'leaves', 'fins', 'petals'))}.",
        "== Ecology ==\n"
        f"{genus} {epithet} is active from {_pick(rng, ('March', 'April', 'May'))} to "
        f"{_pick(rng, ('August', 'September', 'October'))}. It feeds mainly on "
        f"{_pick(rng, ('pollen', 'algae', 'leaves', 'small insects', 'seeds'))}.",
        "== Distribution ==\n"
        f"The range extends over about {rng.randint(2, 900)} thousand square kilometres, from the "
        f"{_pick(rng, _HABITATS)} of {_pick(rng, _COUNTRIES)} to those of {_pick(rng, _COUNTRIES)}.",
        "== Conservation ==\n"
        f"The species is listed as {_pick(rng, ('least concern', 'near threatened', 'vulnerable', 'endangered'))}. "
        f"Its population has {_pick(rng, ('declined', 'remained stable', 'increased'))} since {rng.randint(1960, 2010)}.",
    ]
    lead = (
        f"{genus} {epithet} is a species of {_pick(rng, ('beetle', 'orchid', 'moth', 'fish', 'shrub', 'herb'))} in the family "
        f"{_pick(rng, _FAMILIES)}. It is found in the {_pick(rng, _HABITATS)} of {_pick(rng, _COUNTRIES)}."
    )
    return [lead] + rng.sample(pool, rng.randint(2, len(pool)))


def _person_sections(rng: random.Random) -> list[str]:
    first, last = _name(rng), _name(rng, 3)
    born = rng.randint(1700, 1960)
    field_name = _pick(rng, _FIELDS)
    pronoun = _pick(rng, ("he", "she"))
    pool = [
        "== Early life ==\n"
        f"{last} was born in {_name(rng, 3)} and studied at the University of {_name(rng, 2)}, where "
        f"{pronoun} completed a thesis on {field_name} in {born + rng.randint(20, 30)}.",
        "== Career ==\n"
        f"Over a career of {rng.randint(10, 50)} years, {last} published {rng.randint(3, 140)} works and "
        f"founded the {_name(rng, 2)} Society for {field_name.title()}.",
        "== Legacy ==\n"
        f"A street in {_name(rng, 3)} and a prize for young researchers in {field_name} are named after {last}. "
        f"The collected letters were published in {rng.randint(1950, 2015)} in {rng.randint(2, 12)} volumes.",
        "== Selected works ==\n"
        + "\n".join(f"* On {_pick(rng, _FIELDS)} ({born + rng.randint(25, 70)})" for _ in range(rng.randint(2, 5))),
    ]
    lead = (
        f"{first} {last} ({born} – {born + rng.randint(35, 95)}) was a {_pick(rng, _COUNTRIES)}n "
        f"{_pick(rng, _PROFESSIONS)} known for work on {field_name}."
    )
    return [lead] + rng.sample(pool, rng.randint(2, len(pool)))


def _wiki_article(rng: random.Random) -> str:
    maker = _pick(rng, (_town_sections, _species_sections, _person_sections))  # type: ignore[arg-type]
    return "\n\n".join(maker(rng))  # type: ignore[operator]


_SE_TOPICS = (
    ("Python", "reverse a list", "xs[::-1]", "list(reversed(xs))"),
    ("Python", "count words in a string", "len(s.split())", "collections.Counter(s.split())"),
    ("Git", "undo the last commit", "git reset --soft HEAD~1", "git revert HEAD"),
    ("Bash", "find large files", "du -ah . | sort -h | tail", "find . -size +100M"),
    ("SQL", "select the newest row per group", "ROW_NUMBER() OVER (PARTITION BY g ORDER BY t DESC)", "MAX(t) with GROUP BY g"),
    ("NumPy", "normalize the rows of a matrix", "a / a.sum(axis=1, keepdims=True)", "a / np.linalg.norm(a, axis=1)[:, None]"),
    ("Python", "read a file line by line", "for line in open(path):", "pathlib.Path(path).read_text().split('\\n')"),
    ("C", "get the length of an array", "sizeof(a) / sizeof(a[0])", "a separate length variable"),
)


def _stackexchange_thread(rng: random.Random) -> str:
    if rng.random() < 0.45:
        a, b = rng.randint(2, 9), rng.randint(1, 20)
        x = rng.randint(1, 30)
        c = a * x + b
        return (
            f"Q: How do I solve {a}x + {b} = {c}?\n\n"
            "I am practising linear equations and I keep getting a different result from the book. "
            f"I first divided everything by {a} and then got lost.\n\n"
            f"A: Subtract {b} from both sides to get {a}x = {c - b}, then divide both sides by {a}. "
            f"So x = {x}. You can check it by substituting back: {a} * {x} + {b} = {a * x} + {b} = {c}.\n\n"
            "A: Dividing first also works, but then you must divide every term, including the constant: "
            f"x + {b}/{a} = {c}/{a}. Subtracting gives the same x = {x}.\n\n"
            f"Comment: Thanks, I was dividing before subtracting. ({rng.randint(1, 90)} votes)"
        )
    lang, task, code1, code2 = _pick(rng, _SE_TOPICS)  # type: ignore[misc]
    return (
        f"Q: How can I {task} in {lang}?\n\n"
        f"I have tried a loop but it is slow for {rng.randint(2, 900)} thousand items. Is there a built-in way? "
        f"I am on {lang} version {rng.randint(2, 12)}.{rng.randint(0, 20)}.\n\n"
        f"A: Use `{code1}`. It is the idiomatic way and runs in linear time. The documentation has an example "
        "under the section on common recipes.\n\n"
        f"A: Another option is `{code2}`, which is clearer if you need the result more than once.\n\n"
        f"Comment: The first answer worked for me, thanks. ({rng.randint(1, 250)} votes)"
    )


_REDDIT_OPENERS = ("lol", "honestly", "ngl", "ok so", "tbh", "wait", "not gonna lie", "omg", "bruh", "same")
_REDDIT_TOPICS = ("my cat", "my roommate", "the new update", "this game", "my landlord", "the bus", "my sourdough", "this sub", "my boss", "the wifi")
_REDDIT_TAILS = ("and i cant even", "10/10 would do again", "anyone else??", "edit: thanks for the gold kind stranger", "rip", "this is the way", "change my mind", "send help", "")


def _reddit_thread(rng: random.Random) -> str:
    comments = []
    for _ in range(rng.randint(3, 12)):
        comments.append(
            f"{_pick(rng, _REDDIT_OPENERS)} {_pick(rng, _REDDIT_TOPICS)} "
            f"{_pick(rng, ('literally', 'just', 'always', 'never', 'kinda', 'somehow'))} "
            f"{_pick(rng, ('ate', 'broke', 'fixed', 'ignored', 'ruined', 'loves', 'deleted'))} "
            f"{_pick(rng, ('everything', 'my keyboard', 'the whole weekend', 'dinner', 'it again', 'my save file'))} "
            f"{_pick(rng, _REDDIT_TAILS)} {_pick(rng, ('😂', '🙃', '', '', '👍', '...'))}".strip()
        )
    return "\n\n".join(comments)


_PRODUCTS = ("garden hose", "desk lamp", "wool scarf", "coffee grinder", "hiking boots", "phone case", "cast iron pan")
_BOILERPLATE = (
    "Home | About | Contact | Privacy Policy",
    "We use cookies to improve your experience. By continuing you accept our use of cookies.",
    "Subscribe to our newsletter for the latest offers.",
    "© All rights reserved.",
    "Share this: Facebook Twitter Email",
    "Skip to main content",
    "Log in | Register | Cart (0)",
)


def _web_block(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        product = _pick(rng, _PRODUCTS)
        return (
            f"{product.title()} - {_name(rng)} Store\n"
            f"Price: ${rng.randint(5, 200)}.{rng.randint(0, 99):02d}. In stock: {rng.randint(0, 40)} units.\n"
            f"This {product} is made from {_pick(rng, ('recycled steel', 'organic cotton', 'bamboo', 'aluminium'))} "
            f"and ships within {rng.randint(1, 10)} business days. Customers rate it {rng.randint(30, 50) / 10} out of 5."
        )
    if kind == 1:
        return (
            f"{_name(rng, 3)} council approves new {_pick(rng, ('library', 'bike lanes', 'school', 'harbour wall'))}\n"
            f"The council of {_name(rng, 3)} voted {rng.randint(5, 15)} to {rng.randint(0, 4)} on Tuesday to fund the "
            f"project, which is expected to cost {rng.randint(1, 90)} million. Construction starts in "
            f"{_pick(rng, ('spring', 'autumn', 'January', 'June'))}. Residents can comment until "
            f"{_pick(rng, ('Friday', 'the end of the month', 'next week'))}."
        )
    return (
        f"Easy {_pick(rng, ('lentil soup', 'banana bread', 'tomato pasta', 'apple pie'))} recipe\n"
        f"Ingredients: {rng.randint(1, 4)} cups of flour, {rng.randint(1, 6)} eggs, a pinch of salt.\n"
        f"Bake at {rng.choice((160, 175, 180, 200))} degrees for {rng.randint(15, 70)} minutes. Serves {rng.randint(2, 8)}."
    )


def _web_page(rng: random.Random) -> str:
    parts = [_pick(rng, _BOILERPLATE)]
    parts += [_web_block(rng) for _ in range(rng.randint(1, 4))]
    parts.append(_pick(rng, _BOILERPLATE))
    # Web text carries Unicode line and paragraph separators now and then; readers must keep them.
    sep = "\u2028" if rng.random() < 0.05 else "\n"
    return sep.join(parts)


_SPAM_WORDS = ("FREE", "CLICK", "BEST", "cheap", "pills", "casino", "$$$", "WIN", "bonus", "crypto", "!!!", "offer", "now", "limited")


def _spam_page(rng: random.Random) -> str:
    words = []
    for _ in range(rng.randint(80, 400)):
        r = rng.random()
        if r < 0.55:
            words.append(_pick(rng, _SPAM_WORDS))
        elif r < 0.8:
            words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(3, 12))))
        elif r < 0.9:
            words.append(f"www.{_name(rng)}{rng.randint(1, 999)}.biz")
        else:
            words.append(_pick(rng, ("\u2029", "|", "***", ">>>", "\u00a0", "#")))
    return " ".join(words)


# ---------------------------------------------------------------------------------------------
# MetaMathQA-style math problems. A family returns a `_Problem`: the question with its numbers,
# a rephrasing, a worked solution and, for the self-verification types (SV, FOBAR), the question
# with one quantity replaced by an unknown and the worked solution for that unknown.


@dataclass
class _Problem:
    question: str
    rephrased: str
    solution: str
    answer: int
    x_question: str | None = None  # "{var}" marks the unknown; None: no linear unknown
    x_solution: str = ""  # worked solution for the unknown, "{var}" marks it
    x_value: int = 0


def _linear_x_solution(coef: int, offset: int, answer: int) -> str:
    """Worked solution of coef * {var} + offset = answer (coef divides answer - offset)."""
    sign = "+" if offset >= 0 else "-"
    return (
        f"The answer can be written as {coef}{{var}} {sign} {abs(offset)}.\n"
        f"We know it equals {answer}, so {coef}{{var}} {sign} {abs(offset)} = {answer}.\n"
        f"Then {coef}{{var}} = {answer - offset}, and dividing by {coef} gives {{var}} = {(answer - offset) // coef}."
    )


def _gsm_clips(rng: random.Random) -> _Problem:
    name, n = _name(rng), 2 * rng.randint(6, 40)
    q = f"{name} sold clips to {n} of her friends in April, and then she sold half as many clips in May. How many clips did {name} sell altogether in April and May?"
    r = f"In April {name} sold {n} clips to friends, and in May she sold half that number. What is the total number of clips sold over the two months?"
    sol = f"In May {name} sold {n} / 2 = {n // 2} clips.\nAltogether she sold {n} + {n // 2} = {n + n // 2} clips."
    total = n + n // 2
    x_sol = (
        f"The total is {{var}} + {{var}} / 2 = 3{{var}} / 2.\nWe know the total is {total}, so 3{{var}} / 2 = {total}.\n"
        f"Multiplying by 2 gives 3{{var}} = {2 * total}, and dividing by 3 gives {{var}} = {n}."
    )
    return _Problem(q, r, sol, total, q.replace(f"to {n} of", "to {var} of"), x_sol, n)


def _gsm_shopping(rng: random.Random) -> _Problem:
    name = _name(rng)
    a, p, b, c = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(2, 15)
    q = f"{name} buys {a} notebooks at ${p} each and {b} pens at ${c} each. How much does {name} spend in total?"
    r = f"If each notebook costs ${p} and each pen costs ${c}, how many dollars does {name} pay for {a} notebooks and {b} pens?"
    total = a * p + b * c
    sol = f"The notebooks cost {a} * {p} = {a * p} dollars.\nThe pens cost {b} * {c} = {b * c} dollars.\nIn total {name} spends {a * p} + {b * c} = {total} dollars."
    return _Problem(q, r, sol, total, q.replace(f"{a} notebooks", "{var} notebooks"), _linear_x_solution(p, b * c, total), a)


def _gsm_travel(rng: random.Random) -> _Problem:
    name = _name(rng)
    s, h, t, v = rng.randint(20, 70), rng.randint(1, 5), rng.randint(1, 4), rng.randint(10, 60)
    q = f"{name} drives at {s} miles per hour for {h} hours and then at {v} miles per hour for {t} more hours. How many miles does {name} drive?"
    r = f"Driving {h} hours at {s} mph followed by {t} hours at {v} mph, what distance in miles does {name} cover?"
    total = s * h + v * t
    sol = f"In the first part {name} drives {s} * {h} = {s * h} miles.\nIn the second part {name} drives {v} * {t} = {v * t} miles.\nThe total distance is {s * h} + {v * t} = {total} miles."
    return _Problem(q, r, sol, total, q.replace(f"for {h} hours", "for {var} hours"), _linear_x_solution(s, v * t, total), h)


def _gsm_savings(rng: random.Random) -> _Problem:
    name = _name(rng)
    d, w = rng.randint(5, 40), rng.randint(4, 30)
    c = rng.randint(1, d * w - 1)
    q = f"{name} saves ${d} every week for {w} weeks and then spends ${c} on a bicycle. How much money does {name} have left?"
    r = f"After saving {d} dollars a week for {w} weeks, {name} buys a bicycle for {c} dollars. How many dollars remain?"
    saved = d * w
    sol = f"{name} saves {d} * {w} = {saved} dollars.\nAfter the purchase {name} has {saved} - {c} = {saved - c} dollars left."
    return _Problem(q, r, sol, saved - c, q.replace(f"for {w} weeks", "for {var} weeks"), _linear_x_solution(d, -c, saved - c), w)


def _gsm_cookies(rng: random.Random) -> _Problem:
    name = _name(rng)
    b, c = rng.randint(2, 8), rng.randint(6, 24)
    e, g = rng.randint(1, 5), rng.randint(1, 10)
    q = f"{name} bakes {b} batches of {c} cookies. {name} eats {e} cookies and gives {g} cookies to a neighbour. How many cookies are left?"
    r = f"There are {b} batches with {c} cookies in each. If {e} cookies are eaten and {g} are given away, how many cookies does {name} still have?"
    made = b * c
    sol = f"{name} bakes {b} * {c} = {made} cookies.\nAfter eating and giving some away, {made} - {e} - {g} = {made - e - g} cookies are left."
    return _Problem(q, r, sol, made - e - g, q.replace(f"bakes {b} batches", "bakes {var} batches"), _linear_x_solution(c, -e - g, made - e - g), b)


def _signed(n: int) -> str:
    """"+ 3" or "- 3", for a term after the first."""
    return f"+ {n}" if n >= 0 else f"- {-n}"


def _math_poly(rng: random.Random) -> _Problem:
    a, b, c, k = rng.randint(1, 6), rng.choice([n for n in range(-9, 10) if n]), rng.randint(1, 20), rng.randint(-5, 6)
    val = a * k * k + b * k + c
    expr = f"{a}x^2 {_signed(b)}x + {{c}}"
    q = f"What is the value of ${expr.format(c=c)}$ when $x = {k}$?"
    r = f"Evaluate the expression ${expr.format(c=c)}$ at $x = {k}$."
    sol = (
        f"Substituting $x = {k}$ gives ${a}({k})^2 + ({b})({k}) + {c} = {a * k * k} {_signed(b * k)} + {c} = \\boxed{{{val}}}$."
    )
    xq = f"What is the value of ${expr.format(c='{var}')}$ when $x = {k}$?"
    return _Problem(q, r, sol, val, xq, _linear_x_solution(1, a * k * k + b * k, val), c)


def _math_linear(rng: random.Random) -> _Problem:
    a, x, b = rng.randint(2, 12), rng.randint(-15, 15), rng.choice([n for n in range(-30, 31) if n])
    c = a * x + b
    lhs = f"{a}x {_signed(b)}"
    q = f"Solve for $x$: ${lhs} = {c}$."
    r = f"Find the value of $x$ that satisfies the equation ${lhs} = {c}$."
    step = f"Subtracting {b} from both sides" if b > 0 else f"Adding {-b} to both sides"
    sol = f"{step} gives ${a}x = {c - b}$.\nDividing by {a} gives $x = \\boxed{{{x}}}$."
    x_sol = f"Substituting $x = {x}$ into the left-hand side gives ${a}({x}) {_signed(b)} = {a * x} {_signed(b)} = {c}$.\nSo {{var}} = {c}."
    return _Problem(q, r, sol, x, f"Solve for $x$: ${lhs} = {{var}}$.", x_sol, c)


def _math_rectangle(rng: random.Random) -> _Problem:
    length, width = rng.randint(2, 40), rng.randint(2, 40)
    per = 2 * length + 2 * width
    q = f"A rectangle has length ${length}$ and width ${width}$. What is its perimeter?"
    r = f"What is the perimeter of a rectangle whose sides measure ${length}$ and ${width}$ units?"
    sol = f"The perimeter is $2 \\cdot {length} + 2 \\cdot {width} = {2 * length} + {2 * width} = \\boxed{{{per}}}$."
    xq = f"A rectangle has length ${{var}}$ and width ${width}$. What is its perimeter?"
    return _Problem(q, r, sol, per, xq, _linear_x_solution(2, 2 * width, per), length)


def _math_binomial(rng: random.Random) -> _Problem:
    n = rng.randint(4, 30)
    val = n * (n - 1) // 2
    q = f"Compute $\\dbinom{{{n}}}{{2}}$."
    r = f"How many ways are there to choose 2 objects from {n} distinct objects?"
    sol = f"$\\dbinom{{{n}}}{{2}} = \\frac{{{n} \\cdot {n - 1}}}{{2}} = \\frac{{{n * (n - 1)}}}{{2}} = \\boxed{{{val}}}$."
    return _Problem(q, r, sol, val)  # not linear in n: never used for SV / FOBAR


_GSM_FAMILIES = (_gsm_clips, _gsm_shopping, _gsm_travel, _gsm_savings, _gsm_cookies)
_MATH_FAMILIES = (_math_poly, _math_linear, _math_rectangle, _math_binomial)


def _metamath_record(type_name: str, rng: random.Random) -> dict:
    families = _GSM_FAMILIES if type_name.startswith("GSM") else _MATH_FAMILIES
    variant = type_name.split("_", 1)[1]
    problem = _pick(rng, families)(rng)  # type: ignore[arg-type]
    while variant in ("SV", "FOBAR") and problem.x_question is None:
        problem = _pick(rng, families)(rng)  # type: ignore[arg-type]
    if variant in ("AnsAug", "Rephrased"):
        query = problem.question if variant == "AnsAug" else problem.rephrased
        response = f"{problem.solution}\nThe answer is: {problem.answer}"
    else:
        assert problem.x_question is not None
        var = "X" if type_name.startswith("MATH") else "x"
        x_question = problem.x_question.replace("{var}", var)
        if variant == "FOBAR":
            query = f"{x_question}\nIf we know the answer to the above question is {problem.answer}, what is the value of unknown variable {var}?"
        else:
            query = f"{x_question} The answer is {problem.answer}. What is the value of unknown variable {var}?"
        response = problem.x_solution.replace("{var}", var) + f"\nThe answer is: {problem.x_value}"
    return {"query": query, "response": response, "type": type_name, "original_question": problem.question}


# ---------------------------------------------------------------------------------------------
# Mol-Instructions-style molecule tasks, with SELFIES strings.

# Functional-group fragments as SELFIES symbol strings, and their names for descriptions.
_FRAGMENTS: dict[str, str] = {
    "benzene ring": "[C][=C][C][=C][C][=C][Ring1][=Branch1]",
    "hydroxy group": "[O]",
    "amino group": "[N]",
    "methyl group": "[C]",
    "ethyl group": "[C][C]",
    "chloro substituent": "[Cl]",
    "fluoro substituent": "[F]",
    "nitrile group": "[C][#N]",
    "ketone group": "[C][=Branch1][C][=O][C]",
    "thioether": "[S][C]",
    "cyclohexane ring": "[C][C][C][C][C][C][Ring1][=Branch1]",
}
_ACID = "[C][=Branch1][C][=O][O]"
_ALCOHOL = "[O]"
_AMINE = "[N]"
_REAGENTS = {
    "esterification": "[O][S][=Branch1][C][=O][=Branch1][C][=O][O]",
    "amide coupling": "[C][C][N][=C][=N][C][C][C][N][Branch1][C][C][C]",
    "halogenation": "[O][=S][Branch1][C][Cl][Cl]",
}


def _molecule(rng: random.Random, n_groups: int) -> tuple[str, list[str]]:
    names = [_pick(rng, list(_FRAGMENTS)) for _ in range(n_groups)]
    chain = "[C]" * rng.randint(1, 3)
    return chain + "".join(_FRAGMENTS[n] for n in names), names


def _mol_design(rng: random.Random) -> tuple[str, str, str]:
    mol, names = _molecule(rng, rng.randint(2, 4))
    role = _pick(rng, ("a metabolite", "a solvent", "an antifungal agent", "a flavouring agent", "a drug precursor"))
    desc = f"The molecule is an organic compound built on a short carbon chain carrying, in order, a {', a '.join(names)}. It has a role as {role}."
    instruction = _pick(
        rng,
        (
            "Create a molecule with the structure as the one described.",
            "Generate a molecule that fits the following description.",
            "Based on the given information, design a molecule that meets the desired specifications.",
        ),
    )
    return instruction, desc, mol


def _reaction(rng: random.Random) -> tuple[str, str, str, str]:
    """One reaction: (reactants "A.B", reagent, product, reaction class)."""
    r1, _ = _molecule(rng, rng.randint(1, 2))
    r2, _ = _molecule(rng, rng.randint(1, 2))
    kind = _pick(rng, tuple(_REAGENTS))
    if kind == "esterification":
        reactants, product = f"{r1}{_ACID}.{r2}{_ALCOHOL}", f"{r1}[C][=Branch1][C][=O][O]{r2}"
    elif kind == "amide coupling":
        reactants, product = f"{r1}{_ACID}.{r2}{_AMINE}", f"{r1}[C][=Branch1][C][=O][N]{r2}"
    else:
        reactants, product = f"{r1}{_ALCOHOL}.{r2}", f"{r1}[Cl]"
    return reactants, _REAGENTS[kind], product, kind


def _mol_forward(rng: random.Random) -> tuple[str, str, str]:
    reactants, reagent, product, _ = _reaction(rng)
    instruction = _pick(
        rng,
        (
            "With the provided reactants and reagents, propose a potential product.",
            "Given the reactants and reagents below, predict the main product.",
            "What product could be formed from the following reactants and reagents?",
        ),
    )
    return instruction, f"{reactants}.{reagent}", product


def _mol_reagent(rng: random.Random) -> tuple[str, str, str]:
    reactants, reagent, product, _ = _reaction(rng)
    instruction = _pick(
        rng,
        (
            "Please suggest some possible reagents that could have been used in the following chemical reaction.",
            "Given this chemical reaction, what reagents could have been used?",
        ),
    )
    return instruction, f"{reactants}>>{product}", reagent


def _mol_retro(rng: random.Random) -> tuple[str, str, str]:
    reactants, _, product, _ = _reaction(rng)
    instruction = _pick(
        rng,
        (
            "Please suggest potential reactants for the given product.",
            "Given the product below, propose the reactants it could be synthesised from.",
            "Provide a possible retrosynthesis for this molecule.",
        ),
    )
    return instruction, product, reactants


_MOL_TASKS = {
    "description_guided_molecule_design": _mol_design,
    "forward_reaction_prediction": _mol_forward,
    "reagent_prediction": _mol_reagent,
    "retrosynthesis": _mol_retro,
}
