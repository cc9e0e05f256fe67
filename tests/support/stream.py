"""Moving a live job's event time forward from the test's side.

A live job fires a shopper's last prompt when the watermark passes the end of its quiet
period. With no more traffic, only the wall clock moves the watermark, after
``job.watermark_idle_advance_s`` plus the lag of the partition's newest record
(``shopperintents.EventTimeWatermarks``): after a restart onto a backlog that lag is the
whole outage, and on a loaded host it grows further. A test that waits for those prompts by
the clock guesses. Instead it writes one more record to every partition, stamped past every
trigger, which the job's decoder dead-letters (it is not an event): the watermark passes
every pending trigger as soon as the job reads it, and a bounded replay of the same topic
sees the same record and renders the same prompts.
"""

from __future__ import annotations

import orjson

from flink_jobs.tools.replay import producer_config

#: What the marker carries: valid JSON that the event schema refuses.
MARKER = orjson.dumps({"marker": "event time moves past every trigger of the replay"})


def move_event_time(bootstrap: str, topic: str, partitions: int, to_ms: int) -> None:
    """Write :data:`MARKER` to each of ``topic``'s ``partitions`` with record timestamp
    ``to_ms``, each in a request of its own (a bounded job's end offset is then exact on
    the embedded broker too: ``docs/event_time.md``)."""
    from confluent_kafka import Producer

    producer = Producer(producer_config(bootstrap, {"linger.ms": 0}))
    for partition in range(partitions):
        producer.produce(topic, MARKER, partition=partition, timestamp=to_ms)
        if producer.flush(30) != 0:
            raise RuntimeError(f"the event-time marker for {topic}[{partition}] was not sent")
