from rlhf.data.arithmetic import is_correct, make_problems


def test_problems_are_correct_distinct_deterministic_and_disjoint():
    a = make_problems(500, seed=1, max_digits=3)
    assert a == make_problems(500, seed=1, max_digits=3)
    assert len({p.prompt for p in a}) == 500
    for p in a:
        x, y = p.prompt.rstrip("=").split("+")
        assert int(p.answer) == int(x) + int(y) and len(x) <= 3 and len(y) <= 3
    b = make_problems(500, seed=2, exclude={p.prompt for p in a})
    assert not {p.prompt for p in a} & {p.prompt for p in b}


def test_verifier():
    assert is_correct("405", "405")
    assert is_correct(" 405<eos>junk", "405")
    assert not is_correct("4050", "405")
    assert not is_correct("40", "405")
    assert not is_correct("", "405")
    assert not is_correct("x405", "405")
