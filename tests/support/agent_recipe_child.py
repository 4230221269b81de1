"""Child process for the agent Ctrl-C test: the recipe's agent, run to its end or to a Ctrl-C.

Arguments: the checkpoint file (resumed when it exists), the stand-in's base URL and the
person's answer. Prints each question asked, then ``answer <json>`` or ``interrupted``.
"""

from __future__ import annotations

import json
import signal
import sys

from openai import AsyncOpenAI

from ekit_runtime import JsonFileStore
from tests.support.agent_recipe import drive, recipe_namespace  # (PYTHONPATH: the checkout)

# As in sigint_child.py: a child started without job control may inherit SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

path, base_url, person = sys.argv[1:4]
client = AsyncOpenAI(api_key="test", base_url=base_url, max_retries=0)
namespace = recipe_namespace(blocks=1)  # the agent only: the stand-in runs in the test
try:
    result = drive(namespace, client, JsonFileStore(path), person, lambda line: print(line, flush=True))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
print("answer " + json.dumps(result.outputs["agent"]), flush=True)
