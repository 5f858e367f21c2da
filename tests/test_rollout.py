"""A rolling restart of a real `stagemesh serve -pp 2 -dp 2 --api-server-count 2` under 16 looping streams:
`stagemesh rollout` restarts its 4 stages, 2 schedulers and 2 routers one at a time (each a new process), and
every answer is complete and token-exact, none lost (streams a draining router leaves are resumed with
Last-Event-ID, requests a draining scheduler hands back at its --shutdown-timeout go on on the other replica)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ops_mesh import Load, Serve
from parity import prompts
from tiny_models import greedy_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 48
SERVICES = ["stage[0.0]", "stage[0.1]", "stage[1.0]", "stage[1.1]", "scheduler[0]", "scheduler[1]", "router[0]",
            "router[1]"]


def test_rolling_restart_of_pp2_dp2_under_16_streams_loses_nothing(tiny_model_dir, tmp_path):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    batch = prompts(384, (5, 40, 17, 70, 3, 33, 9, 51))
    want = greedy_tokens(model_dir, batch, NEW_TOKENS)
    with Serve(model_dir, tmp_path, "-pp", "2", "-dp", "2", "--api-server-count", "2", "--shutdown-timeout", "2",
               "--resume-grace-period", "20") as serve:
        serve.wait_ready(2)
        before = {name: serve.pid(name) for name in SERVICES}
        with Load([serve.base_url], str(model_dir), batch, want, NEW_TOKENS, clients=16) as load:
            load.wait_answers(16)
            done = subprocess.run([sys.executable, "-m", "stagemesh", "rollout"], env=serve.env, capture_output=True,
                                  text=True, timeout=400)
            assert done.returncode == 0, done.stdout + done.stderr + serve.text()[-4000:]
            during = len(load.answers)
            load.wait_answers(during + 16)
        answered = load.check()
        after = {name: serve.pid(name) for name in SERVICES}
        assert all(after[n] != before[n] for n in SERVICES), (before, after)  # every service is a new process
        log = serve.text()
        order = [m.group(1) for m in re.finditer(r"step \d+/8: restart (\S+)", log)]
        assert order == SERVICES, order
        assert "operation" in done.stdout and "succeeded" in done.stdout
        print(f"{answered} answers, {sum(a[3] for a in load.answers)} resumed stream(s), "
              f"{len(re.findall('continuing it on another replica', log))} continuation(s)")
