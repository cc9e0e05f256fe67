"""Replay planning and file formats, without a broker (delivery to an address where nothing
listens, and its metrics endpoint: tests/service/test_replay_delivery.py)."""

from __future__ import annotations

import csv
import io
import itertools
import socket
from pathlib import Path

import orjson
import pytest

from flink_jobs.tools.replay import (
    InputFormatError,
    PlannedSend,
    SourceRecord,
    event_time_ms,
    main,
    parse_csv,
    parse_jsonl,
    parse_recording,
    plan_replay,
    read_records,
    shopper_key,
    write_recording,
)
from flink_jobs.tools.sample_data import (
    BadRecords,
    SampleConfig,
    format_event_time,
    generate_sample,
)
from tests.support.builders import T0, raw_event


def event(shopper: str = "s1", seconds: float = 0.0, event_id: str | None = None, **extra) -> bytes:
    return raw_event(shopper, seconds, event_id=event_id, **{"query": "running shoes", **extra})


MALFORMED = b'{"event_id": "x", "shopper_id": "s9"'
INVALID_UTF8 = b'{"event_id":"x","shopper_id":"s9","query":"\xff"}'


class TestKeysAndTimes:
    @pytest.mark.parametrize(
        ("value", "key"),
        [
            (event("shopper-1"), b"shopper-1"),
            (MALFORMED, None),
            (INVALID_UTF8, None),
            (b'{"event_id": "x"}', None),
            (b'{"shopper_id": 42}', None),
            (b'{"shopper_id": ""}', None),
            (b'["shopper_id"]', None),
            (b'{"shopper_id": "caf\xc3\xa9"}', "café".encode()),
        ],
    )
    def test_shopper_key(self, value, key):
        assert shopper_key(value) == key

    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            ("2026-06-01T09:00:00.000Z", T0),
            ("2026-06-01T09:00:00.123Z", T0 + 123),
            ("2026-06-01T11:00:00.000+02:00", T0),
            ("2026-06-01T09:00:00.000123Z", T0),
            (T0, T0),
            ("2026-06-01T09:00:00", None),  # no offset
            ("2026-06-01", None),
            ("yesterday", None),
            (True, None),
            (-5, None),
            (None, None),
            (1.5, None),
        ],
    )
    def test_event_time_ms(self, value, expected):
        assert event_time_ms(value) == expected


class TestPlan:
    def test_default_sends_everything_at_once_in_file_order(self):
        values = [event("a", 0), event("b", 5), MALFORMED, event("a", 9)]
        plan = plan_replay(values)
        assert [p.value for p in plan] == values
        assert [p.send_at_s for p in plan] == [0.0] * 4
        assert [p.key for p in plan] == [b"a", b"b", None, b"a"]
        assert all(isinstance(p, PlannedSend) for p in plan)

    def test_timestamps_are_event_times_and_unparseable_records_take_their_predecessors(self):
        plan = plan_replay([MALFORMED, event("a", 1), event("b", 4), INVALID_UTF8, event("a", 6)])
        assert [p.timestamp_ms for p in plan] == [
            T0 + 1000,
            T0 + 1000,
            T0 + 4000,
            T0 + 4000,
            T0 + 6000,
        ]

    def test_no_times_at_all(self):
        plan = plan_replay([MALFORMED, INVALID_UTF8], speed=2.0)
        assert [(p.send_at_s, p.timestamp_ms) for p in plan] == [(0.0, None), (0.0, None)]

    def test_speed_divides_the_gaps(self):
        values = [event("a", 0), event("b", 10), event("a", 30)]
        assert [p.send_at_s for p in plan_replay(values, speed=1.0)] == [0.0, 10.0, 30.0]
        assert [p.send_at_s for p in plan_replay(values, speed=10.0)] == [0.0, 1.0, 3.0]
        assert [p.send_at_s for p in plan_replay(values, speed=0.5)] == [0.0, 20.0, 60.0]

    def test_speed_keeps_file_order_for_out_of_order_events(self):
        values = [event("a", 0), event("b", 10), event("c", 4), MALFORMED, event("a", 12)]
        plan = plan_replay(values, speed=1.0)
        assert [p.send_at_s for p in plan] == [0.0, 10.0, 10.0, 10.0, 12.0]
        assert [p.value for p in plan] == values
        assert plan[2].timestamp_ms == T0 + 4000  # the Kafka timestamp stays the event's own

    def test_rate_is_a_fixed_pace(self):
        values = [event("a", 0), event("b", 100), MALFORMED, event("a", 1)]
        assert [p.send_at_s for p in plan_replay(values, rate=4)] == [0.0, 0.25, 0.5, 0.75]

    @pytest.mark.parametrize(
        "kwargs",
        [{"speed": 1.0, "rate": 1.0}, {"speed": 0.0}, {"rate": -1.0}, {"rebase_anchor": "middle"}],
    )
    def test_bad_arguments(self, kwargs):
        with pytest.raises(ValueError):
            plan_replay([event()], **kwargs)

    def test_recorded_records_keep_key_and_timestamp(self):
        records = [
            SourceRecord(event("a", 0), key=b"other", timestamp_ms=5, recorded=True),
            SourceRecord(MALFORMED, key=b"kept", timestamp_ms=7000, recorded=True),
            SourceRecord(event("b", 0), key=None, timestamp_ms=None, recorded=True),
        ]
        plan = plan_replay(records, speed=2.0)
        assert [(p.key, p.timestamp_ms) for p in plan] == [
            (b"other", 5),
            (b"kept", 7000),
            (None, 7000),
        ]
        assert [p.send_at_s for p in plan] == [0.0, 3.4975, 3.4975]


class TestRebase:
    NOW = 1_900_000_000_000

    def test_first_event_lands_on_now_and_gaps_are_kept(self):
        values = [MALFORMED, event("a", 0), event("b", 2.5), event("a", 60)]
        plan = plan_replay(values, rebase_to_ms=self.NOW)
        assert [p.timestamp_ms for p in plan] == [
            self.NOW,
            self.NOW,
            self.NOW + 2500,
            self.NOW + 60000,
        ]
        for p in plan[1:]:
            assert event_time_ms(orjson.loads(p.value)["event_time"]) == p.timestamp_ms

    def test_last_anchor_puts_the_latest_event_at_now(self):
        values = [event("a", 0), event("b", 90), event("c", 30)]
        plan = plan_replay(values, rebase_to_ms=self.NOW, rebase_anchor="last")
        assert [p.timestamp_ms for p in plan] == [self.NOW - 90000, self.NOW, self.NOW - 60000]

    def test_only_event_time_changes_byte_for_byte(self):
        original = (
            b'{ "event_id" : "e1",  "shopper_id":"a", "event_type":"search",'
            b' "event_time" :  "2026-06-01T09:00:00.000Z",'
            b' "query":"caf\\u00e9 \\"event_time\\": x"}'
        )
        (planned,) = plan_replay([original], rebase_to_ms=self.NOW)
        new_time = format_event_time(self.NOW).encode()
        assert planned.value == original.replace(b"2026-06-01T09:00:00.000Z", new_time)

    def test_epoch_millisecond_times_stay_integers(self):
        original = orjson.dumps(
            {
                "event_id": "e1",
                "shopper_id": "a",
                "event_type": "search",
                "event_time": T0,
                "query": "q",
            }
        )
        (planned,) = plan_replay([original], rebase_to_ms=self.NOW)
        assert orjson.loads(planned.value)["event_time"] == self.NOW

    def test_bad_records_reach_the_topic_unchanged(self):
        sample = generate_sample(SampleConfig(shoppers=40, seed=2, bad=BadRecords()))
        plan = plan_replay(sample.records, rebase_to_ms=self.NOW)
        bad = {b["index"] for b in sample.expected.bad_records}
        for index in bad:
            assert plan[index].value == sample.records[index]
        for index, (planned, raw) in enumerate(zip(plan, sample.records, strict=True)):
            if index in bad:
                continue
            assert planned.value != raw
            before, after = orjson.loads(raw), orjson.loads(planned.value)
            assert after == {**before, "event_time": after["event_time"]}
        for dup in sample.expected.duplicate_records:  # redeliveries stay identical
            assert plan[dup["index"]].value == plan[dup["duplicate_of"]].value

    def test_recorded_values_are_rebased_too(self):
        records = [SourceRecord(event("a", 10), key=b"a", timestamp_ms=T0 + 10_000, recorded=True)]
        (planned,) = plan_replay(records, rebase_to_ms=self.NOW)
        assert planned.timestamp_ms == self.NOW
        assert orjson.loads(planned.value)["event_time"] == format_event_time(self.NOW)

    def test_send_anchor_with_speed_follows_the_replay_clock(self):
        values = [event("a", 0), event("b", 60), event("c", 30), MALFORMED, event("a", 120)]
        plan = plan_replay(values, speed=10.0, rebase_to_ms=self.NOW, rebase_anchor="send")
        assert [p.send_at_s for p in plan] == [0.0, 6.0, 6.0, 6.0, 12.0]
        # gaps shrink by the factor; the out-of-order event stays behind its predecessor
        assert [p.timestamp_ms for p in plan] == [
            self.NOW,
            self.NOW + 6000,
            self.NOW + 3000,
            self.NOW + 3000,
            self.NOW + 12000,
        ]
        for p in plan:
            if p.value != MALFORMED:
                assert event_time_ms(orjson.loads(p.value)["event_time"]) == p.timestamp_ms
            assert p.timestamp_ms <= self.NOW + p.send_at_s * 1000  # never ahead of the send

    def test_send_anchor_with_rate_stamps_each_send(self):
        values = [event("a", 0), event("b", 500), event("c", 1)]
        plan = plan_replay(values, rate=2.0, rebase_to_ms=self.NOW, rebase_anchor="send")
        assert [p.timestamp_ms for p in plan] == [self.NOW, self.NOW + 500, self.NOW + 1000]

    def test_send_anchor_needs_pacing(self):
        with pytest.raises(ValueError, match="speed or rate"):
            plan_replay([event()], rebase_to_ms=self.NOW, rebase_anchor="send")

    def test_custom_validity_rule(self):
        (planned,) = plan_replay([event("a", 0)], rebase_to_ms=self.NOW, is_valid=lambda doc: False)
        assert planned.value == event("a", 0)
        assert planned.timestamp_ms == self.NOW


class TestFiles:
    def test_jsonl_keeps_bytes_and_skips_blank_lines(self):
        data = event("a") + b"\r\n\n" + INVALID_UTF8 + b"\n   \n" + MALFORMED
        assert [r.value for r in parse_jsonl(data)] == [event("a"), INVALID_UTF8, MALFORMED]

    def test_csv_rows_become_events(self):
        text = (
            "event_id,shopper_id,event_type,event_time,product_id,title,category,brand,price,query,quantity\n"
            'e1,s1,add_to_cart,2026-06-01T09:00:00.000Z,sku-1,"Mug, 350 ml",Kitchen,Acme,12.5,,2\n'
            "e2,s1,search,1780304400000,,,,,,red mug,\n"
            "e3,s2,view,2026-06-01T09:00:01.000Z,sku-2,,,,twelve,,\n"
        )
        docs = [orjson.loads(r.value) for r in parse_csv(text)]
        assert docs == [
            {
                "event_id": "e1",
                "shopper_id": "s1",
                "event_type": "add_to_cart",
                "event_time": "2026-06-01T09:00:00.000Z",
                "product": {
                    "product_id": "sku-1",
                    "title": "Mug, 350 ml",
                    "category": "Kitchen",
                    "brand": "Acme",
                    "price": 12.5,
                },
                "quantity": 2,
            },
            {
                "event_id": "e2",
                "shopper_id": "s1",
                "event_type": "search",
                "event_time": T0,
                "query": "red mug",
            },
            # a value that doesn't convert stays as it was, for the pipeline to refuse
            {
                "event_id": "e3",
                "shopper_id": "s2",
                "event_type": "view",
                "event_time": "2026-06-01T09:00:01.000Z",
                "product": {"product_id": "sku-2", "price": "twelve"},
            },
        ]

    def test_csv_with_dotted_product_columns(self):
        text = "event_id,shopper_id,product.product_id,product.price\ne1,s1,sku-9,3\n"
        (record,) = parse_csv(text)
        assert orjson.loads(record.value)["product"] == {"product_id": "sku-9", "price": 3}

    def test_csv_of_the_sample_round_trips(self):
        sample = generate_sample(SampleConfig(shoppers=20, seed=4, bad=BadRecords.none()))
        columns = [
            "event_id",
            "shopper_id",
            "event_type",
            "event_time",
            "product_id",
            "title",
            "category",
        ]
        columns += ["brand", "price", "query", "quantity"]
        out = io.StringIO()
        writer = csv.DictWriter(out, columns)
        writer.writeheader()
        docs = [orjson.loads(r) for r in sample.records]
        for doc in docs:
            writer.writerow(
                {k: v for k, v in doc.items() if k != "product"} | doc.get("product", {})
            )
        assert [orjson.loads(r.value) for r in parse_csv(out.getvalue())] == docs

    @pytest.mark.parametrize(
        "text",
        ["shopper_id,event_type\ns1,view\n", "", "event_id,shopper_id\ne1,s1,extra\n"],
    )
    def test_csv_errors_name_the_problem(self, text):
        with pytest.raises(InputFormatError):
            parse_csv(text, source="x.csv")

    def test_recording_round_trip(self, tmp_path: Path):
        records = [
            SourceRecord(
                event("a"), key=b"a", timestamp_ms=T0, recorded=True, partition=0, offset=0
            ),
            SourceRecord(
                INVALID_UTF8, key=None, timestamp_ms=None, recorded=True, partition=1, offset=7
            ),
            SourceRecord(
                b"", key=b"\x00\xff", timestamp_ms=1, recorded=True, partition=0, offset=1
            ),
        ]
        path = tmp_path / "rec.jsonl"
        write_recording(path, "topic-a", records)
        assert read_records(path) == records
        assert parse_recording(path.read_bytes()) == records

    def test_truncated_recording_is_refused(self, tmp_path: Path):
        path = tmp_path / "rec.jsonl"
        write_recording(
            path, "t", [SourceRecord(b"x", recorded=True), SourceRecord(b"y", recorded=True)]
        )
        path.write_bytes(path.read_bytes().rsplit(b"\n", 2)[0] + b"\n")
        with pytest.raises(InputFormatError, match="truncated"):
            read_records(path)

    def test_format_detection(self, tmp_path: Path):
        (tmp_path / "e.jsonl").write_bytes(event("a") + b"\n" + MALFORMED + b"\n")
        (tmp_path / "e.csv").write_text("event_id,shopper_id\ne1,s1\n")
        assert [r.value for r in read_records(tmp_path / "e.jsonl")] == [event("a"), MALFORMED]
        assert orjson.loads(read_records(tmp_path / "e.csv")[0].value) == {
            "event_id": "e1",
            "shopper_id": "s1",
        }
        # an explicit format wins over the extension
        (tmp_path / "e.txt").write_text("event_id,shopper_id\ne1,s1\n")
        assert len(read_records(tmp_path / "e.txt", "csv")) == 1

    def test_shipped_sample_plans(self):
        root = Path(__file__).resolve().parents[2]
        records = read_records(root / "data" / "sample_sessions.jsonl")
        expected = orjson.loads((root / "data" / "sample_sessions.expected.json").read_bytes())
        plan = plan_replay(records, speed=60.0)
        assert len(plan) == expected["records"]
        assert all(a.send_at_s <= b.send_at_s for a, b in itertools.pairwise(plan))
        assert plan[-1].send_at_s < expected["generator"]["duration_s"] / 60.0 + 1
        keyed = {p.key.decode() for p in plan if p.key is not None}
        assert set(expected["qualifying_shoppers"]) <= keyed


class TestShell:
    def test_cli_refuses_conflicting_or_bad_timing(self, tmp_path: Path):
        path = tmp_path / "e.jsonl"
        path.write_bytes(event("a") + b"\n")
        with pytest.raises(SystemExit):
            main(["replay", str(path), "--speed", "2", "--rate", "5"])
        with pytest.raises(SystemExit):
            main(["replay", str(path), "--speed", "0"])
        with pytest.raises(SystemExit):
            main(["replay", str(path), "--rebase-time", "send"])

    def test_cli_reports_unreadable_input(self, tmp_path: Path, capsys):
        assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
        assert "missing.jsonl" in capsys.readouterr().err


class TestMetrics:
    def test_cli_takes_a_metrics_port(self, tmp_path: Path):
        from flink_jobs.tools.replay import _build_parser

        args = _build_parser().parse_args(
            ["replay", "e.jsonl", "--metrics-port", "9108", "--metrics-host", "0.0.0.0"]
        )
        assert (args.metrics_port, args.metrics_host, args.metrics_linger) == (9108, "0.0.0.0", 0.0)

    def test_cli_reports_a_port_it_cannot_serve(self, tmp_path: Path, capsys):
        path = tmp_path / "e.jsonl"
        path.write_bytes(event("a") + b"\n")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            assert main(["replay", str(path), "--metrics-port", str(port), "--quiet"]) == 2
        assert "cannot serve metrics" in capsys.readouterr().err
