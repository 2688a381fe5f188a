"""An OpenAI-compatible chat-completions endpoint in front of the engines, for agent programs that speak that API.

The run opens one session per episode and calls the user's agent function (`agent.function`, `module:fn`) with
the episode's data row, the session's base URL and the run's token: `fn(row, base_url, api_key) -> reward`. The
function talks to `POST {base_url}/chat/completions` as to any OpenAI server (the `openai` client with that
base_url and api_key, or plain HTTP); what the session recorded is the episode the trainer sees.

Token in, token out, across requests: a session keeps its token ids (`rlhf.agents.episode.Episode`). The first
request's messages are rendered (`ChatFormat`) and tokenized as the prompt; each later request must repeat the
messages already in the session, assistant replies as they were sent, and only the messages after them are
rendered, tokenized on their own and appended (observation tokens, out of the loss) before the next turn is
sampled from the session's ids as they are. Earlier turns are never re-rendered or re-tokenized. A request whose
messages differ from what the session holds is refused (409) and its episode ends as `token_mismatch`.

Requests of all sessions are gathered for `window_s` and sent to the engines in one `generate` call (each
session's turns to one engine, as for environments). Loopback only (127.0.0.1), and every request must carry
`Authorization: Bearer <the run's token>`. Sampling is the run's (rollout.temperature; greedy for held-out
evaluation): a request's temperature and top_p are ignored, its `max_tokens` and `stop` are used.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Sequence

from rlhf.agents.episode import Episode, Limits, Status, TokenMismatch
from rlhf.agents.runner import Generate, turn_seed


@dataclass(frozen=True)
class ChatFormat:
    """How messages become text: each message by its role's template (`{content}` filled in), and the text that
    opens the assistant's reply. The default fits a model without a chat template (the tiny world): contents as
    they are. A Qwen3 model: `{"user": "<|im_start|>user\\n{content}<|im_end|>\\n", ...}` and
    `"<|im_start|>assistant\\n"`."""

    roles: Mapping[str, str] = field(default_factory=lambda: {"system": "{content}", "user": "{content}",
                                                              "tool": "{content}"})
    assistant_prefix: str = ""

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        out = []
        for m in messages:
            role = m.get("role")
            if role not in self.roles:
                raise ValueError(f"a message of role {role!r}: this endpoint renders {', '.join(self.roles)} "
                                 "(the assistant's messages are what it sampled)")
            content = m.get("content")
            if not isinstance(content, str):
                raise ValueError(f"a {role} message's content is {type(content).__name__}: give text")
            out.append(self.roles[role].format(content=content))
        return "".join(out) + self.assistant_prefix


class Refused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Session:
    key: int  # the episode's index
    row: Any
    limits: Limits
    episode: Episode | None = None  # made by the first request
    messages: list = field(default_factory=list)  # what the client sent and was sent, in order
    waiting_since: float = field(default_factory=time.monotonic)  # the agent's turn began (its last reply)
    busy: bool = False  # a request of it is being answered


class ChatEndpoint:
    """Sessions over one `generate` (`rlhf.agents.runner.Generate`). `open(key, row)` -> the session's base URL."""

    def __init__(self, generate: Generate, tok, limits: Limits, fmt: ChatFormat = ChatFormat(), seed: int = 0,
                 window_s: float = 0.02, model: str = "policy"):
        self.generate, self.tok, self.limits, self.fmt, self.seed = generate, tok, limits, fmt, seed
        self.window_s, self.model = window_s, model
        self.token = secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self.by_key: dict[int, Session] = {}  # the same sessions by episode
        self.lock = threading.Lock()
        self.requests: queue.Queue = queue.Queue()
        self.counts = {"requests": 0}
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                endpoint._serve(self)

            def log_message(self, *args):  # quiet: the run logs per step
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 4096  # every episode's agent may connect at once (socketserver's default: 5)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True, name="chat-endpoint"),
                         threading.Thread(target=self._batches, daemon=True, name="chat-batches")]
        for t in self._threads:
            t.start()

    # --- the run's side ---

    def open(self, key: int, row: Any) -> str:
        """A new session for episode `key` (its data row): its base URL (`.../sessions/<id>/v1`)."""
        sid = secrets.token_hex(8)
        with self.lock:
            self.sessions[sid] = self.by_key[key] = Session(key, row, self.limits)
        return f"{self.url}/sessions/{sid}/v1"

    def episodes(self, keys_rows: Sequence[tuple[int, Any]], prompt_of: Callable[[Any], Sequence[int]]) -> list[Episode]:
        """Each session's episode, in `keys_rows` order; a session that never asked anything gets an empty
        episode from the row's prompt (`prompt_of`), ended as env_error by the caller if it has no status."""
        out = []
        for key, row in keys_rows:
            s = self.by_key.get(key)
            if s is None or s.episode is None:
                out.append(Episode(key, row, tuple(prompt_of(row)), self.limits))
            else:
                out.append(s.episode)
        return out

    def session_of(self, key: int) -> Session | None:
        return self.by_key.get(key)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.requests.put(None)

    # --- HTTP ---

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        try:
            if h.headers.get("Authorization", "") != f"Bearer {self.token}":
                raise Refused(401, "give the run's token: Authorization: Bearer <api_key the run passed>")
            parts = h.path.rstrip("/").split("/")  # "", sessions, <id>, v1, chat, completions
            if len(parts) != 6 or parts[1] != "sessions" or parts[3:] != ["v1", "chat", "completions"]:
                raise Refused(404, f"no such path {h.path}: POST <base_url>/chat/completions, base_url the one "
                                   "the run passed")
            session = self.sessions.get(parts[2])
            if session is None:
                raise Refused(404, f"no session {parts[2]!r} in this run")
            try:
                body = json.loads(h.rfile.read(int(h.headers.get("Content-Length", 0))) or b"{}")
            except (ValueError, json.JSONDecodeError) as e:
                raise Refused(400, f"the request body is not JSON ({e})") from None
            reply = self._complete(session, body)
            self._send(h, 200, reply)
        except Refused as e:
            self._send(h, e.code, {"error": {"message": str(e), "type": "invalid_request_error", "code": e.code}})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    # --- one request ---

    def _complete(self, s: Session, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused(400, "give messages: a list of {role, content}")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        with self.lock:
            if s.busy:
                raise Refused(409, "this session is answering another request: one request at a time")
            if s.episode is not None and not s.episode.running:
                raise Refused(409, f"this episode is over ({s.episode.status.value}"
                                   f"{': ' + s.episode.error if s.episode.error else ''})")
            s.busy = True
        try:
            context = self._extend(s, messages)
            if s.episode.turns >= self.limits.max_turns:
                s.episode.end(Status.max_turns)
                raise Refused(400, f"the episode reached agent.max_turns={self.limits.max_turns}")
            room = s.episode.room()
            if room <= 0:
                s.episode.end(Status.max_tokens)
                raise Refused(400, f"the episode's context is full (agent.max_tokens={self.limits.max_tokens})")
            cap = body.get("max_tokens") or body.get("max_completion_tokens")
            room = min(room, int(cap)) if isinstance(cap, int) and cap > 0 else room
            done = threading.Event()
            item = {"session": s, "context": context, "room": room, "stop": stop, "done": done}
            self.requests.put(item)
            done.wait()
            if "error" in item:
                raise Refused(500, item["error"])
            out = item["out"]
            try:
                s.episode.sampled_completion(context, out)
            except TokenMismatch as e:  # the episode ended as token_mismatch
                raise Refused(409, str(e)) from None
            text = self.tok.decode(list(out.token_ids), skip_special_tokens=True)
            s.messages.append({"role": "assistant", "content": text})
            finish = "stop" if getattr(out, "finish_reason", "stop") == "stop" else "length"
            self.counts["requests"] += 1
            return {"id": f"chatcmpl-{secrets.token_hex(6)}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish, "logprobs": None}],
                    "usage": {"prompt_tokens": len(context), "completion_tokens": len(out.token_ids),
                              "total_tokens": len(context) + len(out.token_ids)}}
        finally:
            s.busy = False
            s.waiting_since = time.monotonic()

    def _extend(self, s: Session, messages: list) -> list[int]:
        """The session's ids with the request's new messages appended (tokenized on their own); the first request's
        messages are the prompt. Refused where the request does not repeat what the session holds."""
        try:
            if s.episode is None:
                prompt = self.tok.encode(self.fmt.render(messages)).ids  # with the tokenizer's own BOS
                s.episode = Episode(s.key, s.row, tuple(prompt), self.limits)
                s.messages = [dict(m) for m in messages]
                return s.episode.context()
            held = len(s.messages)
            if [_msg(m) for m in messages[:held]] != [_msg(m) for m in s.messages]:
                at = next((i for i, (a, b) in enumerate(zip(messages, s.messages)) if _msg(a) != _msg(b)),
                          min(len(messages), held))
                s.episode.end(Status.token_mismatch, error=f"request message {at} differs from what the session "
                              "holds (earlier turns are never re-rendered: send them back as they were)")
                raise Refused(409, s.episode.error)
            new = messages[held:]
            if not new:
                raise Refused(400, "no new message after the session's last reply")
            ids = self.tok.encode(self.fmt.render(new), add_special_tokens=False).ids
        except ValueError as e:
            raise Refused(400, str(e)) from None
        if not s.episode.observed(ids, time.time()):
            raise Refused(400, f"the new messages do not fit the episode's context (agent.max_tokens="
                               f"{self.limits.max_tokens})")
        s.messages += [dict(m) for m in new]
        return s.episode.context()

    # --- batching ---

    def _batches(self) -> None:
        while True:
            first = self.requests.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self.requests.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self.requests.put(None)
                    break
                batch.append(item)
            for stop, group in _by_stop(batch):
                try:
                    outs = self.generate([i["context"] for i in group], [i["room"] for i in group], stop,
                                         [turn_seed(self.seed, i["session"].key, i["session"].episode.turns)
                                          for i in group], [i["session"].key for i in group])
                    for i, o in zip(group, outs):
                        i["out"] = o
                except Exception as e:  # every waiting request is told, none hangs
                    for i in group:
                        i["error"] = f"generation failed: {type(e).__name__}: {e}"
                for i in group:
                    i["done"].set()


def _msg(m: Any) -> tuple:
    return (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, m)


def _by_stop(batch: list[dict]) -> list[tuple[tuple[str, ...], list[dict]]]:
    """Requests with the same stop strings share a generate call."""
    groups: dict[tuple[str, ...], list[dict]] = {}
    for item in batch:
        groups.setdefault(tuple(item["stop"]), []).append(item)
    return list(groups.items())


def load_function(spec: str) -> Callable:
    """The agent function `module:fn` (`agent.function`), refused with what to change."""
    from rlhf.agents.environment import import_named
    from rlhf.errors import ConfigError

    fn = import_named(spec, "function", "rlhf.agents.chat_agent:retry")
    if not callable(fn):
        raise ConfigError(f"{spec} is not callable (an agent function is fn(row, base_url, api_key) -> reward)")
    return fn


def run_agent_function(fn: Callable, generate: Generate, tok, rows: Sequence, limits: Limits,
                       fmt: ChatFormat = ChatFormat(), seed: int = 0) -> tuple[list[Episode], dict]:
    """One episode per row: `fn(row, base_url, api_key)` on a daemon thread of its own against a session of a
    fresh endpoint, its return value the episode's reward. An agent silent for `limits.step_timeout_s` after a
    reply (or its start) ends as `timeout` and is left behind; one that raises, returns something other than a
    finite number, or never asks anything ends as `env_error`. Returns the episodes in row order and counts."""
    import math
    from collections import Counter

    from rlhf.agents.runner import _Call

    endpoint = ChatEndpoint(generate, tok, limits, fmt, seed)
    try:
        calls = []
        for key, row in enumerate(rows):
            url = endpoint.open(key, row)
            calls.append(_Call(lambda row=row, url=url: fn(row, url, endpoint.token)))
            calls[-1].start()
        timed_out: set[int] = set()
        pending = set(range(len(rows)))
        while pending:
            for k in list(pending):
                s = endpoint.session_of(k)
                if not calls[k].is_alive():
                    pending.discard(k)
                elif not s.busy and time.monotonic() - s.waiting_since > limits.step_timeout_s:
                    timed_out.add(k)
                    pending.discard(k)
                    if s.episode is not None:
                        s.episode.end(Status.timeout, error=f"the agent sent nothing for agent.step_timeout_s="
                                                            f"{limits.step_timeout_s} s")
            time.sleep(0.02)
        eps = endpoint.episodes(list(enumerate(rows)), lambda row: tok.encode(row.prompt).ids)
        for k, (ep, call) in enumerate(zip(eps, calls)):
            reward = call.out
            if k in timed_out:
                ep.end(Status.timeout, error=f"the agent ran past agent.step_timeout_s={limits.step_timeout_s} s")
            elif call.error is not None:
                ep.end(Status.env_error, error=f"the agent function raised {type(call.error).__name__}: {call.error}")
            elif endpoint.session_of(k).episode is None:
                ep.end(Status.env_error, error="the agent function made no request")
            elif isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                ep.end(Status.env_error, error=f"the agent function returned {reward!r}: return a finite number")
            elif ep.running:
                ep.end(Status.done, reward)
            elif ep.trained:  # max_turns or max_tokens: the agent's reward still counts
                ep.reward = float(reward)
        counts = Counter(ep.status.value for ep in eps)
        counts["env_steps"] = endpoint.counts["requests"]
        return eps, counts
    finally:
        endpoint.close()
