"""Shutdown edges, with real processes and real signals: a second Ctrl-C while draining exits at once (exit
130, no traceback) and answers what it cuts short with 503, never 500; Ctrl-C while the model is still being
fetched exits quietly in one line (130). (The tensor-parallel rank that fails at start is in
tests/parallel/test_parallel.py.)"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time

import httpx
import pytest

from tests.support.helpers import LineReader, ServerProcess, image_b64, python_module


def test_a_second_sigint_while_draining_exits_at_once_with_503s_and_no_traceback():
    with ServerProcess("--max-batch-size", "4", "--drain-timeout-s", "60", "--log-level", "info") as server:
        image = image_b64(448, 448)

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                async def one(i: int):
                    try:
                        return await client.post(server.url + "/encode", json={
                            "req_id": f"r{i}", "modality": "image", "mm_items": [image]})
                    except httpx.HTTPError as exc:
                        return exc

                in_flight = [asyncio.ensure_future(one(i)) for i in range(60)]
                waited = time.monotonic()  # until most are admitted (a loaded machine takes seconds to send them)
                while (await client.get(server.url + "/server_info")).json()["pending"] < 40:
                    assert time.monotonic() - waited < 60, "the requests were never admitted"
                    await asyncio.sleep(0.1)
                server.proc.send_signal(signal.SIGINT)  # drain: 60 large images take seconds here
                await asyncio.sleep(0.3)
                second = time.monotonic()
                server.proc.send_signal(signal.SIGINT)  # exit at once
                answers = await asyncio.gather(*in_flight)
                return second, answers

        second, answers = asyncio.run(scenario())
        code = server.proc.wait(timeout=20)
        exit_s = time.monotonic() - second
        time.sleep(0.2)  # the output copier catches up
        log = server.log()
    assert code == 130, log
    assert exit_s < 10, f"exited {exit_s:.1f} s after the second signal"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "signal 2 again: exiting now" in log
    failures = [answer for answer in answers if isinstance(answer, Exception)]
    assert not failures, failures
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 503}, statuses
    cut_short = [answer for answer in answers if answer.status_code == 503]
    assert cut_short, "the second signal came while requests were still queued"
    # Cut short by the second signal, or (on a loaded machine) sent after the first and refused by the drain.
    messages = [answer.json()["message"] for answer in cut_short]
    assert all("shutting down" in message or "draining" in message for message in messages), messages
    assert any("shutting down" in message for message in messages), messages
    # What the log says of them is what happened: the requests in flight at the second signal that finished are
    # among the 200s (others finished during the drain before it), those cut short among the 503s (others were
    # refused by the drain); and every 503 is one error line, or counted in a line that says how many were left out.
    told = re.search(r"of the (\d+) requests in flight then, (\d+) finished \(200\) and (\d+) were cut short", log)
    assert told, log
    in_flight, finished, cut = (int(n) for n in told.groups())
    assert in_flight == finished + cut and finished <= statuses.count(200) and cut <= len(cut_short), told.group(0)
    logged = len(re.findall(r"answered 503 to POST /encode", log))
    left_out = sum(int(n) for n in re.findall(r"\((\d+) more error answers were not logged", log))
    assert logged + left_out == len(cut_short), (logged, left_out, len(cut_short))


@pytest.fixture(scope="module")
def stalled_hub_env(tmp_path_factory):
    """The variables of a "Hub" that accepts connections and never answers (the fetch hangs); one for the module,
    so that both signals' servers fork from one zygote (another environment costs another)."""
    home = tmp_path_factory.mktemp("stalled-hub-home")
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(16)
        yield {"HF_ENDPOINT": f"http://127.0.0.1:{stalled.getsockname()[1]}", "HF_HUB_OFFLINE": "0",
               "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "60", "HF_HUB_DOWNLOAD_TIMEOUT": "60"}


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_while_the_model_is_fetched_exits_quietly_in_one_line(stalled_hub_env, signum, code):
    env = stalled_hub_env
    process = python_module("encode_server", "--model", "org/stalled", "--port", "0", env=env, stderr_to_stdout=True)
    reader = LineReader(process.stdout, "resolving model org/stalled")
    try:
        assert reader.seen.wait(120) and process.poll() is None, reader.text()
        time.sleep(1.0)  # inside the fetch, which waits on the silent Hub
        assert process.poll() is None, reader.text()
        interrupted = time.monotonic()
        process.send_signal(signum)
        status = process.wait(timeout=20)
        exit_s = time.monotonic() - interrupted
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.thread.join(10)
    output = reader.text()
    assert status == code, output
    assert exit_s < 5
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    after = output.split("resolving model org/stalled", 1)[1].strip().splitlines()
    name = signal.Signals(signum).name
    assert len(after) == 1 and f"interrupted ({name}) before the server was ready" in after[0], output


def test_ctrl_c_at_any_point_of_the_start_is_quiet():
    """Wherever the start is when Ctrl-C comes (loading, warming up, listening), the exit is 130 or, once it
    serves, a drain's 0: never a death by the signal (-2) after a KeyboardInterrupt traceback."""
    process = python_module("encode_server", "--port", "0", "--log-level", "warning", stderr_to_stdout=True)
    try:
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = process.stdout.read()
    assert code in (0, 130), output  # 0 when it was already serving and drained
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
