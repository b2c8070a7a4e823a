"""The reference pages name what the code emits: metric names, error codes, ``status`` fields and the
config docstring's keys and defaults.

Each list is read out of the source (its syntax tree, not a running node), so a metric, a code or a
field added without a word in the docs fails here, and so does a name the docs keep after the code
dropped it. The pages drifted before: the metrics page lacked the disk and agent-budget families, no
page listed the error codes a node answers, and ``peer_frames_refused`` was in no page.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from collections.abc import Iterator

import pytest
from mnesite.core import membership
from mnesite.rlog import config

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

METRICS_PAGE = REPO / "docs" / "operations" / "metrics.md"
WIRE_PAGE = REPO / "docs" / "reference" / "wire-protocol.md"
CODE = re.compile(r"^[a-z][a-z_]*[a-z]$")
# Where a node answers requests from (the client's own modules raise codes of their own, listed apart).
NODE_DIRS = ("core", "rlog", "replicant", "bootstrap")
CLIENT_MODULES = {"rlog/client.py", "rlog/dbapi.py"}
# Modules whose ``REJECT_*`` reasons a core answers as the error code (core.node's ProposalRejected).
REJECTION_MODULES = {"core/consensus.py", "core/membership.py"}
# Codes answered through a value no call names: (code, the module that makes it, the text there).
INDIRECT_CODES = (
    ("guard_failed", "core/rules.py", 'return "guard_failed", failure.describe()'),
    ("bad_frame", "rlog/messages.py", 'code: str = "bad_frame"'),
    ("internal", "rlog/server.py", 'getattr(error, "code", "internal")'),
)


def tree(relative: str) -> ast.Module:
    return ast.parse((REPO / relative).read_text())


def node_modules() -> Iterator[str]:
    for folder in NODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative not in CLIENT_MODULES:
                yield relative


def string_constants(module: ast.Module) -> dict[str, str]:
    return {
        node.targets[0].id: node.value.value
        for node in module.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def class_codes(module: ast.Module) -> set[str]:
    """``code = "..."`` in a class body (an exception class's code)."""
    return {
        statement.value.value
        for node in ast.walk(module)
        if isinstance(node, ast.ClassDef)
        for statement in node.body
        if isinstance(statement, ast.Assign)
        and [getattr(target, "id", None) for target in statement.targets] == ["code"]
        and isinstance(statement.value, ast.Constant)
    }


def codes_in(relatives: Iterator[str] | set[str]) -> set[str]:
    """The error codes ``relatives`` make: the code argument of ``*Error(...)`` and ``error(...)`` calls (a
    literal or a module constant), exception classes' ``code``, and the rejection reasons of the
    consensus and membership rules that a core answers as codes (not those it answers as done)."""
    found: set[str] = set()
    for relative in relatives:
        module = tree(relative)
        constants = string_constants(module)
        for node in ast.walk(module):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if not (name.endswith("Error") or name == "error"):
                continue
            for argument in (*node.args[:2], *(k.value for k in node.keywords if k.arg == "code")):
                value = argument.value if isinstance(argument, ast.Constant) else None
                value = constants.get(argument.id) if isinstance(argument, ast.Name) else value
                if isinstance(value, str) and CODE.match(value):
                    found.add(value)
        found |= class_codes(module)
        if relative in REJECTION_MODULES:
            found |= {value for name, value in constants.items() if name.startswith("REJECT_") and CODE.match(value)}
    return found - membership.ALREADY_DONE  # a change already made is answered as done (``unchanged``)


def codes_raised() -> set[str]:
    """Every error code a node answers, the few made otherwise than by a call included."""
    found = codes_in(node_modules())
    for code, relative, text in INDIRECT_CODES:
        assert text in (REPO / relative).read_text(), f"{relative} no longer makes {code} that way: update this test"
        found.add(code)
    return found


def client_codes() -> set[str]:
    """Codes the Python client raises itself, no node having answered them."""
    return codes_in(CLIENT_MODULES - {"rlog/dbapi.py"}) - {"error"} - codes_raised()


def reference_table(heading: str) -> set[str]:
    """The codes in the first column of the table under ``heading`` in the wire-protocol page."""
    text = WIRE_PAGE.read_text()
    assert heading in text, f"{WIRE_PAGE.name} has no {heading!r} section"
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    return {
        code for row in re.findall(r"^\| (`[^|]+)\|", section, re.MULTILINE) for code in re.findall(r"`(\w+)`", row)
    }


def test_every_error_code_a_node_answers_is_in_the_wire_reference() -> None:
    raised = codes_raised()
    assert {"bad_request", "guard_failed", "not_sequencer", "query_budget", "catch_up_timeout"} <= raised  # read
    listed = reference_table("## Error codes")
    assert raised - listed == set(), f"codes a node answers that the reference omits: {sorted(raised - listed)}"
    assert listed - raised == set(), f"codes the reference lists that no node answers: {sorted(listed - raised)}"


def test_the_client_codes_in_the_wire_reference_are_the_clients() -> None:
    listed = reference_table("### Raised by the client")
    assert listed == client_codes(), sorted(listed ^ client_codes())


def declared_metrics() -> set[str]:
    """The metric names ``rlog/metrics.py`` declares, as a scrape shows them (counters with ``_total``)."""
    module = tree("rlog/metrics.py")
    names: set[str] = set()
    counters = {"Counter", "CounterMetricFamily"}
    for node in ast.walk(module):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("mnesite_"):
            names.add(first.value + ("_total" if name in counters else ""))
        elif isinstance(first, ast.JoinedStr):  # f"mnesite_{kind}_generation" over the tx key kinds
            pattern = "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in first.values)
            if pattern.startswith("mnesite_"):
                names |= {pattern.format(kind) for kind in ("applied", "committed", "last")}
    for _, metric, _ in (*_tuple_constant(module, "QUERY_COUNTERS"), *_tuple_constant(module, "CHANGES_COUNTERS")):
        names.add(metric + "_total")
    return names


def _tuple_constant(module: ast.Module, name: str) -> list[tuple[str, str, str]]:
    for node in module.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"rlog/metrics.py has no {name}: update this test")


def metrics_on_page() -> set[str]:
    return set(re.findall(r"\bmnesite_[a-z_]*[a-z]\b", METRICS_PAGE.read_text()))


def test_every_metric_the_code_declares_is_on_the_metrics_page() -> None:
    declared = declared_metrics()
    assert {"mnesite_commits_total", "mnesite_committed_counter", "mnesite_queries_total"} <= declared  # read
    assert declared - metrics_on_page() == set(), sorted(declared - metrics_on_page())


def test_the_metrics_page_names_only_metrics_the_code_declares() -> None:
    unknown = metrics_on_page() - declared_metrics()
    assert unknown == set(), sorted(unknown)


METRIC_TYPES = {"Counter": "counter", "CounterMetricFamily": "counter", "Histogram": "histogram"}
METRIC_TYPES |= {"GaugeMetricFamily": "gauge", "_gauge": "gauge"}


def declared_metric_shapes() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Metric name as a scrape shows it -> (type, labels), from the calls of ``rlog/metrics.py``."""
    module = tree("rlog/metrics.py")
    shapes: dict[str, tuple[str, tuple[str, ...]]] = {}
    for node in ast.walk(module):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        kind = METRIC_TYPES.get(
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        )
        if kind is None:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            names = [first.value]
        elif isinstance(first, ast.JoinedStr):
            pattern = "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in first.values)
            names = [pattern.format(kind_) for kind_ in ("applied", "committed", "last")]
        else:
            continue  # _gauge's own body: GaugeMetricFamily(name, ...)
        labels_node = next((k.value for k in node.keywords if k.arg == "labels"), None)
        if labels_node is None and kind == "gauge" and len(node.args) == 3:  # _gauge(name, text, labels)
            labels_node = node.args[2]
        labels = tuple(ast.literal_eval(labels_node)) if labels_node is not None else ()
        for name in names:
            shapes[name + ("_total" if kind == "counter" else "")] = (kind, labels)
    for _, metric, _ in (*_tuple_constant(module, "QUERY_COUNTERS"), *_tuple_constant(module, "CHANGES_COUNTERS")):
        shapes[metric + "_total"] = ("counter", ())
    return shapes


def metrics_table_shapes() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each ``mnesite_`` metric of the metrics page's table -> (type, labels) as the page states them: a
    row's types pair with its names (one type: every name has it)."""
    shapes: dict[str, tuple[str, tuple[str, ...]]] = {}
    for row in re.findall(r"^\| (`mnesite_.*)$", METRICS_PAGE.read_text(), re.MULTILINE):
        cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
        named = re.findall(r"`(mnesite_[a-z_]+)(?:\{([a-z_,]+)\})?`", cells[0])
        types = [kind.strip() for kind in cells[1].split(",")]
        assert len(types) in (1, len(named)), row
        for index, (name, labels) in enumerate(named):
            shapes[name] = (types[index if len(types) > 1 else 0], tuple(labels.split(",")) if labels else ())
    return shapes


def test_the_metrics_page_states_each_metrics_type_and_labels() -> None:
    """A type or a label the page states otherwise than the code breaks a query written from the page
    (``rate()`` over a gauge, ``by (shard)`` over a metric without it)."""
    declared, stated = declared_metric_shapes(), metrics_table_shapes()
    assert declared["mnesite_elections_total"] == ("counter", ("shard",))  # read, with labels
    assert declared["mnesite_fsync_seconds"] == ("histogram", ())
    assert set(stated) == set(declared), sorted(set(stated) ^ set(declared))
    wrong = {name: (stated[name], shape) for name, shape in declared.items() if stated[name] != shape}
    assert wrong == {}, f"metric: (the page's type and labels, the code's): {wrong}"


def status_fields(relative: str) -> set[str]:
    """The string keys of the dicts a node's ``status()`` builds (its own fields, not its parts')."""
    keys: set[str] = set()
    for function in ast.walk(tree(relative)):
        if isinstance(function, ast.FunctionDef) and function.name == "status":
            for node in ast.walk(function):
                if isinstance(node, ast.Dict):
                    keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return keys


def test_every_status_field_is_named_in_the_docs() -> None:
    pages = " ".join(path.read_text() for path in (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))))
    for relative in ("core/node.py", "replicant/node.py"):
        fields = status_fields(relative)
        assert {"shards", "sends_dropped"} <= fields, relative  # read
        missing = {field for field in fields if not re.search(rf"\b{field}\b", pages)}
        assert missing == set(), f"{relative}: status fields no page names: {sorted(missing)}"


def docstring_example(module_doc: str) -> dict:
    example = module_doc.split("Example::", 1)[1].split("\nA node whose", 1)[0]
    lines = [line[4:] for line in example.splitlines() if line.startswith("    ")]
    return tomllib.loads("\n".join(lines))


def test_the_config_docstring_example_lists_every_key_with_the_codes_default() -> None:
    data = docstring_example(config.__doc__ or "")
    sections = {"limits": config.Limits, "rlog": config.Retention, "cluster": config.Timing}
    for section, cls in sections.items():
        named = set(data[section]) - {"core_nodes", "initial_cluster_state"}
        assert named == {f.name for f in dataclasses.fields(cls)}, (
            section,
            sorted(named ^ {f.name for f in dataclasses.fields(cls)}),
        )
        for key in named:
            assert data[section][key] == getattr(cls(), key), (section, key)
