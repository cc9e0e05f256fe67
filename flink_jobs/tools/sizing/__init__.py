"""``shopper-intents plan``: the resources a rate of events needs, from measured unit costs.

- ``costs``: the unit costs read from the benchmarks' results files, each with the file
  and key it came from (pure: parsed documents in);
- ``gpus``: the GPU throughputs the plan assumes when none is given;
- ``trigger_rate``: the trigger rate (prompts and LLM calls per accepted event) of a
  sequence of events, from the job's own session and trigger code replayed offline (pure);
- ``model``: the plan's arithmetic (pure);
- ``render``: the plan as a text table, as markdown and as JSON;
- ``command``: the command line, the only part that reads files.
"""
