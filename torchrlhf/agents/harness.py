"""Black-box agent harnesses: a user's agent function talks to the policy through an OpenAI-compatible endpoint.

``rollout.agent.harness.fn: pkg.mod:run_agent`` is called once per trajectory, in a thread of its own, as
``run_agent(base_url, row) -> float``: ``base_url`` is a per-trajectory ``http://127.0.0.1:PORT/<session>/v1``
for ``openai.OpenAI(base_url=..., api_key="unused")``, ``row`` the data row, the return value the reward
(``reward: env``). The endpoint serves ``/chat/completions`` (tool calls parsed from the model's Hermes
``<tool_call>`` blocks into OpenAI's ``tool_calls``) and ``/completions``.

Why a server per rollout worker and not per call: the trajectories are sampled together, as the agent
sessions of one ``engine.generate(..., sessions=)`` (`sample_sessions`), at the policy's current weights.
Each trajectory's first call opens its session (a `_Segment`); a model turn answers the waiting call, and the
trajectory's next call, which extends the conversation, is the session's observation. So the native engine
keeps the trajectory's keys/values in its parked slot while the harness works and the other slots decode,
and prefills only the new tokens; an engine that runs sessions in rounds (vLLM) samples every waiting call
together, its prefix cache sparing the re-prefill. The sampling parameters are the run's
(``rollout.temperature`` ...): a request's own ``temperature`` / ``top_p`` are ignored, so the recorded
log-probs are the policy's; its ``max_tokens`` caps the call.

Every call is recorded by session as token ids and the engine's log-probs. A request whose messages
start with the session's previous messages plus the answer it got is rendered as the chat template's
*delta* after the sampled tokens (`ChatRenderer.delta_tokens`, as our own agent sessions do), so the
trajectory stays token-exact even when the template would re-render the model's turn differently. A call
whose prompt does not extend the previous call's tokens starts a new segment (counted: ``harness_splits``),
sampled in the next ``generate`` once the current one ends (as is a trajectory's first call that comes after
the others' have started); the trajectory's sample is its last segment, the one that holds the final answer.
With ``check_tokens``, that segment's conversation is re-rendered from text (its answers as the decoded model
tokens) and the tokens that differ are counted (``token_mismatches``; ``error`` stops the run on one).

A harness that raises, or runs past ``harness.timeout_s``, gives an error sample (``agent_error``, scored
``on_error_score``); a timed-out thread cannot be killed and is left behind (a daemon), its later requests
refused. The server binds to loopback (``harness.host``): anyone who reaches it can sample the policy.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
import typing
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


from torchrlhf.agents.agent import Agent
from torchrlhf.agents.parsing import openai_tool_calls
from torchrlhf.agents.render import ChatRenderer, TokenCheck, row_messages
from torchrlhf.agents.session import TokenMismatchError, Trajectory
from torchrlhf.generation.session import TurnResult

log = logging.getLogger(__name__)

Harness = Callable[[str, dict[str, Any]], Any]
# ``drive(sessions, seeds)``: one ``generate`` running agent sessions to their ends, each from its own sample seed
# (`torchrlhf.generation.base.sample_sessions` bound to an engine's generate and the run's sampling); returns
# each session's model-token log-probs.
SessionGenerate = Callable[[list[Any], list[int]], list[list[float]]]


@dataclass
class Call:
    """One recorded endpoint call: its prompt and sampled tokens, their log-probs, why it stopped, and (a chat
    call) the request's messages and tools, which ``check_tokens`` re-renders."""

    prompt: list[int]
    completion: list[int]
    logps: list[float]
    finish_reason: str
    messages: list[dict[str, Any]] | None = None
    tools: Any = None


@dataclass
class _Session:
    row: dict[str, Any]
    seed: int
    calls: list[Call] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None  # the last chat call's messages + the answer it got
    reward: float = 0.0
    error: str | None = None  # "raised" | "timeout" | "bad_reward"
    done: bool = False
    deadline: float = 0.0


@dataclass
class _Request:
    session: str
    kind: str  # "chat" | "completions"
    body: dict[str, Any]
    reply: dict[str, Any] | None = None
    status: int = 200
    ready: threading.Event = field(default_factory=threading.Event)


class _Listener(ThreadingHTTPServer):
    """A threaded HTTP server whose listen backlog holds every trajectory's connection at once: with
    socketserver's default of 5, a step's 64 harnesses connecting together had connections refused
    (``APIConnectionError`` in 23-44 % of trajectories of the calculator harness recipe)."""

    request_queue_size = 1024
    daemon_threads = True


class HarnessServer:
    """The OpenAI-compatible HTTP endpoint; requests wait in ``requests`` until the dispatcher answers them."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, wait_s: float = 600.0) -> None:
        self.requests: queue.Queue[_Request] = queue.Queue()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                m = re.fullmatch(r"/([^/]+)/v1/(chat/completions|completions)", self.path)
                if m is None:
                    return self._send(404, _error(f"no route {self.path}; use /<session>/v1/chat/completions"))
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                except json.JSONDecodeError as e:
                    return self._send(400, _error(f"the request body is not JSON: {e}"))
                request = _Request(m.group(1), "chat" if m.group(2) == "chat/completions" else "completions", body)
                server.requests.put(request)
                if not request.ready.wait(wait_s):
                    return self._send(504, _error("no answer in time (the rollout ended or timed out)"))
                self._send(request.status, request.reply or {})

            def do_GET(self) -> None:  # noqa: N802
                if re.fullmatch(r"/[^/]+/v1/models", self.path):
                    return self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
                self._send(404, _error(f"no route {self.path}"))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # quiet: one line per call would flood the logs
                pass

        self._httpd = _Listener((host, port), Handler)
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="harness-server", daemon=True)
        self._thread.start()

    def base_url(self, session: str) -> str:
        return f"http://{self.host}:{self.port}/{session}/v1"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class HarnessRunner:
    """Runs a harness per row, serves its calls as the agent sessions of the engine's ``generate``, and turns
    the recorded calls into trajectories.

    Args:
        agent: the run's `Agent`: its renderer, budgets, ``on_error`` and ``spec.harness`` settings. The
            first calls are sampled together once every live trajectory has sent one, or when none has come
            for ``harness.batch_wait_s`` (the other harnesses are busy with their own work; 0.05 s split a
            step's first calls, as 16 harness threads start, into batches of 1-2 and 14-15).
        harness: ``run_agent(base_url, row) -> float``.
    """

    def __init__(self, agent: Agent, harness: Harness) -> None:
        self.agent, self.harness = agent, harness
        spec = agent.spec
        self.batch_wait_s = spec.harness.batch_wait_s
        self.server = HarnessServer(spec.harness.host, wait_s=spec.harness.timeout_s + 5.0)
        self._renderers: dict[str, ChatRenderer] = {}
        self._lock = threading.Lock()  # a session's calls: written by the engine's thread and the router
        build_openai_reply_models()

    def close(self) -> None:
        self.server.close()

    # ------------------------------------------------------------------ the rollout
    def run(self, rows: Sequence[dict[str, Any]], seeds: Sequence[int],
            drive: SessionGenerate) -> tuple[list[Trajectory], list[list[float]]]:
        """One trajectory per row (``seeds[i]`` seeds row i's calls); each with its model-token log-probs."""
        timeout = self.agent.spec.harness.timeout_s
        sessions = {uuid.uuid4().hex: _Session(dict(row), int(seed)) for row, seed in zip(rows, seeds, strict=True)}
        for sid, session in sessions.items():
            session.deadline = time.monotonic() + timeout
            threading.Thread(target=self._call_harness, args=(sid, session), name=f"harness-{sid[:8]}",
                             daemon=True).start()
        pending: list[_Request] = []
        while (pending := self._gather(sessions, pending)) is not None:
            pending = self._drive(pending, sessions, drive)
        # requests from timed-out harnesses that arrive later are refused by the next run's dispatcher
        results = [self._trajectory(s) for s in sessions.values()]
        return [t for t, _ in results], [lp for _, lp in results]

    def _gather(self, sessions: Mapping[str, _Session], pending: list[_Request]) -> list[_Request] | None:
        """Collect requests until every live trajectory has one waiting, or none came for ``batch_wait_s``
        (the other harnesses are busy); None when no trajectory is live and none waits."""
        last_at = time.monotonic()
        while True:
            self._expire(sessions)
            live = [s for s in sessions.values() if not s.done]
            pending = [r for r in pending if not self._refused(r, sessions)]
            if not live and not pending:
                return None
            try:
                request = self.server.requests.get(timeout=0.01)
                if not self._refused(request, sessions):
                    pending.append(request)
                    last_at = time.monotonic()
            except queue.Empty:
                pass
            if pending and not (len(pending) < len(live) and time.monotonic() - last_at < self.batch_wait_s):
                return pending

    def _drive(self, requests: list[_Request], sessions: Mapping[str, _Session],
               drive: SessionGenerate) -> list[_Request]:
        """Open a segment for each request and run them all in one ``drive``; while it runs, `_route` hands each
        trajectory's next call to its segment. Returns the requests that belong to no open segment."""
        segments: dict[str, _Segment] = {}
        later: list[_Request] = []
        for request in requests:
            session = sessions[request.session]
            try:
                prompt, budget, _ = self._prepare(request, session)
            except _BadRequest as e:
                self._answer(request, 400, _error(str(e)))
                continue
            if budget <= 0:  # the trajectory's token budget is spent
                self._reply(request, session, prompt, Call(prompt, [], [], "length"))
            elif request.session in segments:  # a second call made while the first waits: after this drive,
                segments[request.session].end_after_turn()  # which must not wait for the trajectory's next call
                later.append(request)
            else:
                segments[request.session] = _Segment(self, session, request, prompt, budget)
        if not segments:
            return later
        stop = threading.Event()
        router = threading.Thread(target=self._route, args=(sessions, segments, stop, later), name="harness-router",
                                  daemon=True)
        router.start()
        try:
            order = list(segments.values())
            logps = drive(order, [seg.seed for seg in order])
        finally:
            stop.set()
            router.join()
        for segment, values in zip(order, logps, strict=True):
            segment.take_logps(values)
        return later

    def _route(self, sessions: Mapping[str, _Session], segments: Mapping[str, _Segment], stop: threading.Event,
               later: list[_Request]) -> None:
        """While a drive runs: give each call that extends its trajectory's open segment to it (the engine's
        next turn), end the segments of trajectories whose harness is done or timed out, or whose call starts
        over (that call goes to ``later``)."""
        while not stop.is_set():
            self._expire(sessions)
            with self._lock:  # a turn's end may be making the segment's next future
                for sid, segment in segments.items():
                    if sessions[sid].done:
                        segment.end()
            try:
                request = self.server.requests.get(timeout=0.01)
            except queue.Empty:
                continue
            if self._refused(request, sessions):
                continue
            segment = segments.get(request.session)
            session = sessions[request.session]
            if segment is None or not segment.waiting:
                if segment is not None:
                    segment.end_after_turn()  # a second call while a turn is in flight: a new segment
                later.append(request)
                continue
            with self._lock:
                try:
                    prompt, budget, _ = self._prepare(request, session)
                except _BadRequest as e:
                    self._answer(request, 400, _error(str(e)))
                    continue
                if not _extends(segment.calls[-1], prompt):
                    segment.end()
                    later.append(request)
                elif budget <= 0:
                    self._reply(request, session, prompt, Call(prompt, [], [], "length"))
                    segment.end()
                else:
                    segment.go_on(request, prompt, budget)

    def _expire(self, sessions: Mapping[str, _Session]) -> None:
        now = time.monotonic()
        for session in sessions.values():
            if not session.done and now > session.deadline:
                session.done, session.error = True, "timeout"
                log.warning("harness ran past harness.timeout_s=%gs (%d calls answered): an error sample",
                            self.agent.spec.harness.timeout_s, len(session.calls))

    def _call_harness(self, sid: str, session: _Session) -> None:
        try:
            reward = self.harness(self.server.base_url(sid), session.row)
            try:
                session.reward = float(reward)
            except (TypeError, ValueError):
                log.warning("harness returned %r, not a number: an error sample", reward)
                session.error = "bad_reward"
        except Exception as e:  # noqa: BLE001 - a failing harness is an error sample, never a failed run
            log.warning("harness raised %s: %s", type(e).__name__, e)
            session.error = session.error or "raised"
        session.done = True

    def _refused(self, request: _Request, sessions: Mapping[str, _Session]) -> bool:
        session = sessions.get(request.session)
        if session is None or (session.done and session.error == "timeout"):
            self._answer(request, 410, _error(f"session {request.session!r} is not live (unknown, or timed out)"))
            return True
        return False

    @staticmethod
    def _answer(request: _Request, status: int, reply: dict[str, Any]) -> None:
        request.status, request.reply = status, reply
        request.ready.set()

    def _prepare(self, request: _Request, session: _Session) -> tuple[list[int], int, dict[str, Any]]:
        """(prompt tokens, this call's token budget, the body) of a request."""
        body = request.body
        if int(body.get("n") or 1) != 1:
            raise _BadRequest("n must be 1 (one trajectory per session)")
        if body.get("stream"):
            raise _BadRequest("stream is not supported: ask without it (each call is answered whole)")
        _stop_strings(body)  # a malformed stop is the caller's error, answered now
        if request.kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("'messages' must be a non-empty list")
            prompt = self._chat_prompt(session, [_plain(m) for m in messages], body.get("tools"))
        else:
            text = body.get("prompt")
            if isinstance(text, list) and all(isinstance(t, int) for t in text):
                prompt = list(text)
            elif isinstance(text, str):
                prompt = self.agent.renderer.encode(text)
            else:
                raise _BadRequest("'prompt' must be a string or a list of token ids")
        if not prompt:
            raise _BadRequest("the prompt is empty")
        agent = self.agent
        used = sum(len(c.completion) for c in self._segment(session, prompt))
        budget = agent.max_tokens - used
        if agent.max_trajectory_tokens is not None:
            budget = min(budget, agent.max_trajectory_tokens - len(prompt))
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            budget = min(budget, int(asked))
        return prompt, budget, body

    def _chat_prompt(self, session: _Session, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        renderer = self._renderer(tools)
        prev, last = session.messages, session.calls[-1] if session.calls else None
        if prev is not None and last is not None and len(messages) > len(prev) and messages[:len(prev)] == prev \
                and messages[-1]["role"] != "assistant":
            # the conversation goes on: the template's delta after the sampled tokens (token-exact)
            return last.prompt + last.completion + renderer.delta_tokens(last.completion, messages[len(prev):])
        return renderer.prompt_tokens(messages)

    def _cut_at_stop(self, tokens: list[int], stops: list[str]) -> tuple[list[int], bool]:
        """A turn that reaches one of the request's ``stop`` strings ends with the token that completes it (as
        `SamplingParams.stop` does); the tokens sampled after it are dropped. (tokens, whether it was cut)."""
        decode = self.agent.renderer.tokenizer.decode
        if not stops or not _has_stop(decode(tokens, skip_special_tokens=True), stops):
            return tokens, False
        low, high = 1, len(tokens)  # the shortest prefix whose text holds a stop string (containment grows with it)
        while low < high:
            mid = (low + high) // 2
            if _has_stop(decode(tokens[:mid], skip_special_tokens=True), stops):
                high = mid
            else:
                low = mid + 1
        return tokens[:low], True

    def _renderer(self, tools: Any) -> ChatRenderer:
        key = json.dumps(tools, sort_keys=True) if tools else ""
        if key not in self._renderers:
            base = self.agent.renderer
            schemas = [t.get("function", t) if isinstance(t, Mapping) else t for t in tools] if tools else None
            self._renderers[key] = base if not tools else ChatRenderer(
                base.tokenizer, tools=schemas, observation_role=base.observation_role)
        return self._renderers[key]

    def _reply(self, request: _Request, session: _Session, prompt: list[int], call: Call) -> None:
        decode = self.agent.renderer.tokenizer.decode
        text = _before_stop(decode(call.completion, skip_special_tokens=True), _stop_strings(request.body))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(call.completion),
                 "total_tokens": len(prompt) + len(call.completion)}
        common = {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": "policy",
                  "usage": usage}
        if request.kind == "completions":
            return self._answer(request, 200, {**common, "object": "text_completion", "choices": [
                {"index": 0, "text": text, "finish_reason": call.finish_reason, "logprobs": None}]})
        content, tool_calls = openai_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        reason = "tool_calls" if tool_calls and call.finish_reason == "stop" else call.finish_reason
        if call.completion:
            session.messages = [_plain(m) for m in request.body["messages"]] + [_plain(message)]
        self._answer(request, 200, {**common, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}]})

    # ------------------------------------------------------------------ recording
    @staticmethod
    def _segment(session: _Session, next_prompt: list[int] | None = None) -> list[Call]:
        """The calls of the session's current segment (with ``next_prompt``: the one that call would join)."""
        calls = [c for c in session.calls if c.completion]
        segment: list[Call] = []
        for call in [*calls, Call(next_prompt, [], [], "")] if next_prompt is not None else calls:
            if segment and not _extends(segment[-1], call.prompt):
                segment = []
            segment.append(call)
        return [c for c in segment if c.completion]

    def _trajectory(self, session: _Session) -> tuple[Trajectory, list[float]]:
        calls = [c for c in session.calls if c.completion]
        splits = sum(1 for a, b in zip(calls, calls[1:]) if not _extends(a, b.prompt))
        segment = self._segment(session)
        error = session.error is not None
        metrics = {"num_turns": float(len(segment)), "harness_splits": float(splits)}
        if not segment:  # no call sampled anything: an empty response after the row's own prompt
            prompt = self.agent.renderer.prompt_tokens(row_messages(session.row) or [{"role": "user", "content": ""}])
            if self.agent.spec.check_tokens != "off":
                metrics["token_mismatches"] = 0.0
            traj = Trajectory(prompt_tokens=prompt, finish_reason="error" if error else "stop", error=error,
                              metrics=metrics)
            traj.turn_rewards = [session.reward]
            return traj, []
        traj, logps = _concatenate(segment)
        traj.turn_rewards[-1] = session.reward
        traj.final_text = self.agent.renderer.tokenizer.decode(segment[-1].completion, skip_special_tokens=True)
        traj.finish_reason = "error" if error else segment[-1].finish_reason
        traj.error = error
        traj.metrics = metrics
        if self.agent.spec.check_tokens != "off":
            check = self._check_tokens(segment, traj.prompt_tokens + traj.response_tokens)
            metrics["token_mismatches"] = float(check.mismatches if check is not None else 0)
            if check is not None and check.mismatches and self.agent.spec.check_tokens == "error":
                raise TokenMismatchError(
                    f"harness: re-rendering the conversation from text differs from the trajectory's tokens at "
                    f"{check.mismatches} position(s), first at token {check.first_mismatch}")
        return traj, logps

    def _check_tokens(self, segment: Sequence[Call], tokens: list[int]) -> TokenCheck | None:
        """``check_tokens``: the segment's conversation (its last call's messages, each answer the endpoint gave in
        them and the last turn as the decoded model tokens) re-rendered from text against the trajectory's tokens.
        None for a segment of ``/completions`` calls (no conversation to re-render)."""
        last = segment[-1]
        if last.messages is None:
            return None
        renderer = self._renderer(last.tools)
        messages = list(last.messages)
        for call in segment[:-1]:  # the next call's messages start with this call's messages and its answer
            at = len(call.messages or ())
            if call.messages is not None and at < len(messages) and messages[at]["role"] == "assistant":
                messages[at] = {"role": "assistant", "content": renderer.turn_content(call.completion)}
        messages.append({"role": "assistant", "content": renderer.turn_content(last.completion)})
        return renderer.check(messages, tokens)


class _Segment:
    """A trajectory's calls that extend one another, as the agent session an engine's ``generate`` drives:
    each model turn is the answer to the waiting call, and the trajectory's next call, when it extends the
    conversation, gives the observation (the tokens its prompt adds) and the next turn's budget."""

    def __init__(self, runner: HarnessRunner, session: _Session, request: _Request, prompt: list[int],
                 budget: int) -> None:
        self.runner, self.session = runner, session
        self.seed = session.seed + len(session.calls)
        self.prompt_tokens = list(prompt)
        self.tokens = list(prompt)  # the whole context of the next turn (what a round-based engine samples after)
        self.calls: list[Call] = []
        self._request: _Request | None = request
        self._budget = budget
        self._future: Future | None = None
        self._last_turn = False

    def turn_budget(self) -> int:
        return self._budget if self._request is not None else 0

    @property
    def waiting(self) -> bool:
        """A turn was answered and the trajectory's next call has not come."""
        return self._future is not None and not self._future.done()

    def end_turn(self, tokens: Sequence[int], finish_reason: str) -> Future:
        with self.runner._lock:
            request = self._request
            tokens, cut = self.runner._cut_at_stop(list(tokens), _stop_strings(request.body))
            chat = request.kind == "chat"
            call = Call(self.tokens, tokens, [], "stop" if cut else finish_reason,
                        [_plain(m) for m in request.body["messages"]] if chat else None,
                        request.body.get("tools") if chat else None)
            self.calls.append(call)
            self.session.calls.append(call)
            self._future = Future()
            if self._last_turn or cut:  # cut: the engine holds the tokens after the stop, so a next call is a new
                self._future.set_result(TurnResult(None))  # segment (re-prefilled), never appended to them
            self._request = None
            self.runner._reply(request, self.session, call.prompt, call)
            return self._future

    def go_on(self, request: _Request, prompt: list[int], budget: int) -> None:
        """The next call extends the conversation: its new tokens are the observation."""
        last = self.calls[-1]
        self._request, self.tokens, self._budget = request, list(prompt), budget
        self._future.set_result(TurnResult(prompt[len(last.prompt) + len(last.completion):]))

    def end(self) -> None:
        if self.waiting:
            self._future.set_result(TurnResult(None))

    def end_after_turn(self) -> None:
        self._last_turn = True

    def result(self) -> Trajectory:
        return _concatenate(self.calls)[0]

    def take_logps(self, values: list[float]) -> None:
        """The engine's log-probs of this segment's model tokens, split over its calls."""
        at = 0
        for call in self.calls:
            call.logps = list(values[at: at + len(call.completion)])
            at += len(call.completion)


def _concatenate(calls: Sequence[Call]) -> tuple[Trajectory, list[float]]:
    """Calls that extend one another as one trajectory (the first call's prompt, then for each call the
    tokens its prompt adds, not trained on, and its completion, trained on) and its log-probs."""
    traj = Trajectory(prompt_tokens=list(calls[0].prompt))
    logps: list[float] = []
    for call in calls:
        observation = call.prompt[len(traj.prompt_tokens) + len(traj.response_tokens):]
        traj.response_tokens.extend(observation)
        traj.loss_mask.extend([0] * len(observation))
        start = len(traj.response_tokens)
        traj.response_tokens.extend(call.completion)
        traj.loss_mask.extend([1] * len(call.completion))
        traj.turn_spans.append((start, start + len(call.completion)))
        traj.turn_rewards.append(0.0)
        logps.extend(call.logps)
    return traj, logps


class _BadRequest(ValueError):
    pass


def _stop_strings(body: Mapping[str, Any]) -> list[str]:
    """The request's ``stop`` as a list (OpenAI: a string, or up to 4 strings); _BadRequest when malformed."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _BadRequest(f"'stop' must be a non-empty string or a list of them, got {stop!r}")
    return stops


def _has_stop(text: str, stops: list[str]) -> bool:
    return any(s in text for s in stops)


def _before_stop(text: str, stops: list[str]) -> str:
    """The text before the first stop string (OpenAI's replies leave the stop sequence out)."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def _extends(call: Call, prompt: list[int]) -> bool:
    done = call.prompt + call.completion
    return len(prompt) > len(done) and prompt[:len(done)] == done


def _plain(message: Any) -> dict[str, Any]:
    """A chat message as the fields the template and the prefix check read (the openai client sends extra
    ``None`` fields back, e.g. ``refusal``)."""
    m = dict(message)
    out = {"role": m.get("role"), "content": m.get("content")}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                               "arguments": c["function"]["arguments"]}}
                             for c in m["tool_calls"]]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("name"):
        out["name"] = m["name"]
    return out


def build_openai_reply_models() -> None:
    """Build the ``openai`` client's reply models now, in this thread, if the client is installed.

    Why: ``openai`` defers building its pydantic models to their first use (``DEFER_PYDANTIC_BUILD``), and that
    build is not thread-safe. When the harness threads first parse and dump replies at the same moment, one can
    read a half-built model and raise ``PydanticUserError: ... BaseModel cannot be instantiated directly`` (it
    failed a CI run): an error sample for a harness that did nothing wrong. Building them before the threads
    start takes ~30 ms.
    """
    try:
        import pydantic
        from openai.types import Completion
        from openai.types.chat import ChatCompletion
    except ImportError:
        return
    seen: set[type] = set()
    todo: list[Any] = [ChatCompletion, Completion]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, pydantic.BaseModel):
            if t not in seen:
                seen.add(t)
                t.model_rebuild()
                todo.extend(f.annotation for f in t.model_fields.values())
        else:
            todo.extend(typing.get_args(t))


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}
