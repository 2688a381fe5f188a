"""An agent program that speaks the OpenAI chat API, trained as it is (`agent.function`, docs/agents.md).

`retry` is the tiny world's arithmetic with feedback written as such a program: it asks the model, checks the
answer, says `feedback` after a wrong one and asks again, up to `tries` times, and returns its reward. It talks
plain HTTP (`chat`, the standard library's urllib); an existing program would use the `openai` client with the
same `base_url` and `api_key`:

    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    reply = client.chat.completions.create(model="policy", messages=messages)
"""

from __future__ import annotations

import json
import urllib.request

from rlhf.data.arithmetic import is_correct


def chat(base_url: str, api_key: str, messages: list[dict], timeout_s: float = 120.0, **params) -> dict:
    """One chat completion: the reply's JSON (`choices[0].message.content` is the text)."""
    body = json.dumps({"model": "policy", "messages": messages, **params}).encode()
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def retry(row, base_url: str, api_key: str, tries: int = 3, feedback: str = " ?", decay: float = 0.5) -> float:
    """The row's prompt as the user's message; a wrong answer is told `feedback` and tried again. A right answer
    at try k: decay ** (k - 1)."""
    messages = [{"role": "user", "content": row.prompt}]
    for k in range(tries):
        answer = chat(base_url, api_key, messages)["choices"][0]["message"]["content"]
        if is_correct(answer, row.answer):
            return decay ** k
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    return 0.0
