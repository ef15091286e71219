"""Multi-turn agent trajectories in token space, served to a generation engine one model turn at a time.

`AgentLoop` owns one Environment per trajectory. A trajectory's tokens are its prompt (the chat template with the
environment's tool schemas and the generation prompt), then per turn the SAMPLED ids exactly as the engine returned
them (EOS kept, never decoded and re-encoded) and the observation's ids: the token delta the chat template adds for
the new tool/user messages, with the generation prompt of the next turn. Model tokens are trained (loss mask 1, the
engine's log-probs); observation tokens are context only (loss mask 0, log-prob 0).

An engine drives it through `TurnSource`: `ready` hands out turns that can start, `done` takes a turn's sampled
ids, `wait` blocks while every live trajectory is waiting for its environment. `done` never blocks: the turn's
text is decoded and `env.step` runs on a daemon thread of its own, so a row waiting for a tool never holds the
engine's batch. A step past `tool_timeout_s` is marked timed out (the observation says so) and the trajectory goes
on; its environment finishes the late call before it takes the next one (one call at a time per environment), and
the late result is dropped. A daemon thread, not a pool worker: a tool that never returns then holds neither a
worker nor the process's exit. An environment that raises fails its trajectory (traceback logged); the caller
fails the stage when too many did (core/ml/agent_rollout.py: check_failures).

A trajectory ends when its environment says done, after max_turns model turns, or when the next turn would have no
room in max_total_tokens (the last two: truncated); a turn that fills the budget is not stepped, and an observation
that leaves no room for a turn is dropped.

Order. `ordered=True` (the hf engine) hands out turns in rounds: a round's turns go out in trajectory order, and
the next round starts only once every turn of this one was generated and stepped, so the engine's batches, hence
the samples, do not depend on how long tools take (a timeout, being wall-clock, still does). Unordered (the static
engine's continuous batching), a trajectory is ready the moment its step returns: no row waits for another's tool,
and which rows share a decode step, so the samples, depends on tool timing.
"""

import heapq
import json
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from verlflow.core.errors import InputError
from verlflow.core.ml.generate import prompt_ids

log = logging.getLogger("verlflow.agent")


@dataclass
class Turn:
    key: int  # trajectory id
    context: list[int]  # every token so far
    budget: int  # new tokens at most for this turn (>= 1)


class TurnSource(Protocol):
    def ready(self, limit: int) -> list[Turn]:
        """Up to `limit` turns that can start now; never blocks."""

    def done(self, turn: Turn, tokens: list[int], logprobs: list[float] | None) -> None:
        """A turn's sampled ids (EOS kept, no padding) and their log-probs (None: the engine could not take them)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a turn is ready (or `timeout` passed); False once every trajectory ended."""

    def ended(self) -> list[int]:
        """The trajectories that ended since the last call: they take no more turns (an engine may free what it
        kept for them)."""


@dataclass(frozen=True)
class Limits:
    max_turns: int  # model turns at most
    max_total_tokens: int  # prompt + every turn; past it a trajectory ends, truncated
    max_new_tokens: int  # one model turn at most
    tool_timeout_s: float  # one env.step's wall clock


@dataclass
class Trajectory:
    """One trajectory's record: its tokens, masks and rewards (turn_rewards: (response position, reward) on each
    turn's last model token), and its counts."""
    key: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    truncated: bool = False
    failed: bool = False
    error: str | None = None  # the environment's traceback
    env_s: float = 0.0
    ended: bool = False

    @property
    def score(self) -> float:
        return sum(v for _, v in self.turn_rewards)


class _Call:
    """One env.step in flight; `stale` once it timed out (its late result is then dropped)."""

    def __init__(self, traj: Trajectory, tokens: list[int], deadline: float):
        self.traj, self.tokens, self.deadline = traj, tokens, deadline
        self.stale = self.finished = False

    def __lt__(self, other: "_Call") -> bool:  # heap order
        return self.deadline < other.deadline


# Messages before the observation when its token delta is rendered (verl's way: render [dummy + new messages] and
# drop the dummy's ids). Ending on an assistant turn is what a tool message follows; a template that renders the
# last assistant turn differently from an earlier one (Qwen3's thinking block) takes the second.
_DUMMIES = ([{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}],
            [{"role": "user", "content": "?"}])


def observation_messages(observation) -> list[dict]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "tool", "content": observation}]
    return list(observation)


class AgentLoop:
    """The trajectories of `rows` (one environment each, `make_env()`), served as a TurnSource; `names`: the rows'
    dataset row numbers, for messages."""

    def __init__(self, tok, make_env: Callable[[], object], rows: list[dict], limits: Limits, *, ordered: bool,
                 max_prompt_len: int, names: list | None = None):
        self.tok, self.limits, self.ordered = tok, limits, ordered
        self._cond = threading.Condition()
        self._tok_lock = threading.Lock()  # a fast tokenizer is not safe to call from several threads at once
        self._bases: dict[tuple[str, int], list[int]] = {}
        self._names = names if names is not None else list(range(len(rows)))
        self.trajs = [Trajectory(k) for k in range(len(rows))]
        self._envs: dict[int, object] = {}
        self._tools: dict[int, list[dict] | None] = {}
        self._env_locks = {k: threading.RLock() for k in range(len(rows))}
        self._queue: deque[int] = deque()  # ready, in arrival order (unordered) or the next round's (ordered)
        self._round: deque[int] = deque()  # ordered: this round's turns not yet handed out
        self._busy = 0  # trajectories generating or stepping
        self._live = len(rows)
        self._calls: list[_Call] = []  # heap by deadline
        self._closers: list[threading.Thread] = []
        self._ended: list[int] = []  # since the last ended()
        self.wait_s = 0.0  # time the engine spent blocked in wait(): waiting for environments
        for t, row in zip(self.trajs, rows):
            self._start(t, make_env, row, max_prompt_len)

    # ----------------------------------------------------------------------------------------- TurnSource

    def ready(self, limit: int) -> list[Turn]:
        with self._cond:
            self._expire(time.monotonic())
            if self.ordered and not self._round and not self._busy:
                self._round = deque(sorted(self._queue))
                self._queue.clear()
            source = self._round if self.ordered else self._queue
            out = []
            while source and len(out) < limit:
                t = self.trajs[source.popleft()]
                self._busy += 1
                context = t.prompt_ids + t.response_ids
                out.append(Turn(t.key, context, min(self.limits.max_new_tokens,
                                                    self.limits.max_total_tokens - len(context))))
            return out

    def done(self, turn: Turn, tokens: list[int], logprobs: list[float] | None) -> None:
        if not 1 <= len(tokens) <= turn.budget:
            raise RuntimeError(f"agent loop: the engine returned {len(tokens)} tokens for trajectory {turn.key}'s "
                               f"turn of budget {turn.budget}")
        with self._cond:
            t = self.trajs[turn.key]
            t.response_ids += tokens
            t.loss_mask += [1] * len(tokens)
            if t.logprobs is not None and logprobs is not None:
                t.logprobs += [float(x) for x in logprobs]
            else:
                t.logprobs = None
            t.turns += 1
            if len(t.prompt_ids) + len(t.response_ids) >= self.limits.max_total_tokens:
                self._busy -= 1
                self._end(t, truncated=True)  # no room left: the cut turn is not stepped
                return
            call = _Call(t, list(tokens), time.monotonic() + self.limits.tool_timeout_s)
            heapq.heappush(self._calls, call)
        threading.Thread(target=self._step, args=(call,), daemon=True, name=f"agent-step-{t.key}").start()

    def wait(self, timeout: float | None = None) -> bool:
        t0 = time.monotonic()
        end = None if timeout is None else t0 + timeout
        with self._cond:
            try:
                while self._live:
                    now = time.monotonic()
                    self._expire(now)
                    if self._has_ready() or (end is not None and now >= end):
                        return True
                    nearest = [c.deadline - now for c in self._calls[:1]] + ([end - now] if end else [])
                    self._cond.wait(min(nearest) if nearest else None)
                return False
            finally:
                self.wait_s += time.monotonic() - t0

    def ended(self) -> list[int]:
        with self._cond:
            keys, self._ended = self._ended, []
            return keys

    # ----------------------------------------------------------------------------------------- results

    def records(self) -> list[Trajectory]:
        """Every trajectory, once all ended."""
        with self._cond:
            if self._live:
                raise RuntimeError(f"agent loop: {self._live} trajectories have not ended")
            return list(self.trajs)

    def shutdown(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for the environments to close (one stuck in a call that never
        returns is left to its daemon thread)."""
        end = time.monotonic() + timeout
        for closer in self._closers:
            closer.join(max(0.0, end - time.monotonic()))
        if left := sum(c.is_alive() for c in self._closers):
            log.warning("agent: %d environments did not close within %g s (a tool call still running)", left, timeout)

    # ----------------------------------------------------------------------------------------- inside

    def _start(self, t: Trajectory, make_env, row: dict, max_prompt_len: int) -> None:
        try:
            env = make_env()
            self._envs[t.key] = env
            messages = env.reset(row)
            tools = env.tools() or None
        except Exception:  # noqa: BLE001 - the environment's failure is this trajectory's, not the stage's
            t.prompt_ids = self._render(row.get("prompt") or [], None, prompt=True)
            self._fail(t, traceback.format_exc())
            return
        self._tools[t.key] = tools
        t.prompt_ids = self._render(messages, tools, prompt=True)
        if len(t.prompt_ids) > max_prompt_len:
            raise InputError(f"data.max_prompt_length={max_prompt_len}: the prompt of dataset row "
                             f"{self._names[t.key]} is {len(t.prompt_ids)} tokens after the chat template with the "
                             "environment's tools; raise data.max_prompt_length or drop overlong prompts.")
        if len(t.prompt_ids) >= self.limits.max_total_tokens:
            raise InputError(f"rollout.agent.max_total_tokens={self.limits.max_total_tokens}: the prompt of dataset "
                             f"row {self._names[t.key]} is {len(t.prompt_ids)} tokens, leaving no room for a turn; "
                             "raise rollout.agent.max_total_tokens.")
        self._queue.append(t.key)

    def _step(self, call: _Call) -> None:
        """On the call's own thread: env.step of the turn's text, its observation's ids, then the result."""
        t = call.traj
        with self._env_locks[t.key]:  # a timed-out call still running finishes first
            if call.stale:  # it timed out while waiting for that one: never run
                return
            with self._tok_lock:
                text = self.tok.decode(call.tokens, skip_special_tokens=True)
            t0 = time.perf_counter()
            try:
                step, error = self._envs[t.key].step(text), None
            except Exception:  # noqa: BLE001
                step, error = None, traceback.format_exc()
            took = time.perf_counter() - t0
            obs = None
            if error is None and not step.done:
                try:
                    obs = self._observation_ids(observation_messages(step.observation), self._tools.get(t.key))
                except Exception:  # noqa: BLE001 - an observation the chat template cannot render
                    error = traceback.format_exc()
            with self._cond:
                t.env_s += took
                call.finished = True
                if call.stale:
                    return
                self._busy -= 1
                if error is not None:
                    self._fail(t, error)
                    return
                self._count(t, step.info)
                t.turn_rewards.append((len(t.response_ids) - 1, float(step.reward)))
                self._next(t, obs, done=step.done)

    def _expire(self, now: float) -> None:
        """Calls past their deadline: marked timed out; their trajectory goes on with an observation that says so."""
        while self._calls and (self._calls[0].finished or self._calls[0].deadline <= now):
            call = heapq.heappop(self._calls)
            if call.finished:
                continue
            call.stale = True
            self._busy -= 1
            t = call.traj
            t.tool_timeouts += 1
            msg = f"The tool call timed out after {self.limits.tool_timeout_s:g} s."
            obs = None if t.turns >= self.limits.max_turns else \
                self._observation_ids(observation_messages(msg), self._tools.get(t.key))
            self._next(t, obs, done=False)

    def _next(self, t: Trajectory, obs: list[int] | None, *, done: bool) -> None:
        """After a step: end the trajectory, or append the observation's ids and make it ready again."""
        obs = obs or []
        if done:
            self._end(t, truncated=False)
        elif t.turns >= self.limits.max_turns:
            self._end(t, truncated=True)
        elif len(t.prompt_ids) + len(t.response_ids) + len(obs) >= self.limits.max_total_tokens:
            self._end(t, truncated=True)  # the observation leaves no room for a turn: dropped
        else:
            t.response_ids += obs
            t.loss_mask += [0] * len(obs)
            if t.logprobs is not None:
                t.logprobs += [0.0] * len(obs)
            self._queue.append(t.key)
            self._cond.notify_all()

    def _count(self, t: Trajectory, info: dict) -> None:
        for k in ("tool_calls", "tool_errors", "tool_timeouts"):
            setattr(t, k, getattr(t, k) + int((info or {}).get(k, 0)))

    def _fail(self, t: Trajectory, error: str) -> None:
        t.failed, t.error = True, error
        log.error("agent: trajectory %d (dataset row %s) failed: its environment raised\n%s", t.key,
                  self._names[t.key], error)
        self._end(t, truncated=False)

    def _end(self, t: Trajectory, *, truncated: bool) -> None:
        t.ended, t.truncated = True, truncated
        self._ended.append(t.key)
        self._live -= 1
        self._cond.notify_all()
        closer = threading.Thread(target=self._close, args=(t,), daemon=True, name=f"agent-close-{t.key}")
        self._closers.append(closer)
        closer.start()

    def _has_ready(self) -> bool:
        if not self.ordered:
            return bool(self._queue)
        return bool(self._round) or (not self._busy and bool(self._queue))

    def _close(self, t: Trajectory) -> None:
        """On a thread of its own: once the environment's last call returned (a timed-out one may still run)."""
        with self._env_locks[t.key]:
            env = self._envs.pop(t.key, None)
            if env is None:
                return
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a failing close loses nothing of the trajectory
                log.warning("agent: closing trajectory %d's environment raised\n%s", t.key, traceback.format_exc())

    # ----------------------------------------------------------------------------------------- tokens

    def _render(self, messages: list[dict], tools, *, prompt: bool) -> list[int]:
        with self._tok_lock:
            return prompt_ids(self.tok, messages, tools, generation_prompt=prompt)

    def _observation_ids(self, messages: list[dict], tools) -> list[int]:
        """The chat template's tokens for `messages` after an assistant turn, with the next generation prompt."""
        if not messages:
            return []
        key = json.dumps(tools, sort_keys=True)
        for i, dummy in enumerate(_DUMMIES):
            if (key, i) not in self._bases:
                self._bases[key, i] = self._render(dummy, tools, prompt=False)
            base = self._bases[key, i]
            full = self._render(dummy + messages, tools, prompt=True)
            if full[:len(base)] == base:
                return full[len(base):]
        raise ValueError("the chat template renders a conversation's start differently once tool/user messages "
                         "follow it: the observation's tokens cannot be appended in token space")
