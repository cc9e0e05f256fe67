"""What the compose test reads from inside the stack's network, printed as one JSON object.

Run by the test as ``docker compose exec -T jobmanager python - < inspect_stack.py``: the
broker advertises its in-network name (kafka:9092), which only the stack's containers
resolve. Reads, with the run summary's own functions (``flink_jobs.tools.run_summary``):
the consumer group's lag on the events topic, the prompts topic and the dead-letter topic.
"""

import json
import os

from flink_jobs.tools.run_summary import group_lag, read_json_topic

BOOTSTRAP = os.environ.get("SI_KAFKA_BOOTSTRAP_SERVERS", "kafka:9092")
print(
    json.dumps(
        {
            "lag": group_lag(BOOTSTRAP, "shopper-intents", "shopper-events"),
            "prompts": read_json_topic(BOOTSTRAP, "shopper-events-prompts", timeout_s=10),
            "dead_letters": read_json_topic(BOOTSTRAP, "shopper-events-dlq", timeout_s=10),
        }
    )
)
