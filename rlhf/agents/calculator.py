"""The calculator tool: arithmetic the policy cannot do in its head, done by a call it learns to make.

A model turn that ends with `<calc>EXPRESSION</calc>` (the turn stops at the closing tag) is answered with
`<result>VALUE</result>`, which the model reads and copies; a turn without a call is its final answer, scored
against the row's answer by the arithmetic task's rule (`rlhf.data.arithmetic.is_correct`). Expressions are
integers with + - * and parentheses, at most `max_chars` characters, evaluated from their syntax tree (never by
`eval`); anything else is answered `<result>error</result>`.
"""

from __future__ import annotations

import ast
import operator

from rlhf.agents.environment import Observation
from rlhf.data.arithmetic import is_correct

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
# The characters a calculator episode is written in with the default tags: the tiny task's alphabet, the tags'
# letters and parentheses. A character tokenizer over it (`rlhf.data.tokenizer.build_tokenizer(64, ALPHABET)`)
# encodes every call and result.
ALPHABET = "0123456789+-*=?: <>/calcresultero()"


def evaluate(expr: str, max_chars: int = 64, max_digits: int = 40) -> int | None:
    """The value of an integer + - * expression, or None if it is anything else (or too long, or its value
    has more than `max_digits` digits)."""
    if len(expr) > max_chars:
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = value(node.left), value(node.right)
            r = _OPS[type(node.op)](a, b)
            if len(str(abs(r))) > max_digits:
                raise OverflowError
            return r
        raise ValueError(type(node).__name__)

    try:
        return value(tree.body)
    except (ValueError, OverflowError, RecursionError):
        return None


class Calculator:
    def __init__(self, open_tag: str = "<calc>", close_tag: str = "</calc>", result: str = "<result>{}</result>",
                 max_chars: int = 64):
        if not open_tag or not close_tag or "{}" not in result:
            raise ValueError("Calculator: open_tag and close_tag must be non-empty and result must hold '{}'")
        self.open_tag, self.close_tag, self.result, self.max_chars = open_tag, close_tag, result, max_chars
        self.stop = (close_tag,)
        self.answer = ""

    def reset(self, row) -> None:
        self.answer = row.answer

    def step(self, text: str) -> Observation:
        end = text.rfind(self.close_tag)
        start = text.rfind(self.open_tag, 0, end) if end >= 0 else -1
        if end >= 0 and start >= 0 and not text[end + len(self.close_tag):].strip():
            v = evaluate(text[start + len(self.open_tag):end], self.max_chars)
            return Observation(text=self.result.format("error" if v is None else v))
        return Observation(done=True, reward=float(is_correct(text, self.answer)))
