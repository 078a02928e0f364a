"""The docs say what the code does: the README's option table is the table."""
import os

from dtralloc.config import format_config_markdown
from dtralloc.replay import format_policies_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_config_table_is_the_generated_one():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    table = format_config_markdown()
    assert table in readme, (
        "README.md's DTRALLOC_CONF table is out of date: paste the output of "
        "`python -m dtralloc config --markdown`"
    )


def test_readme_policy_table_is_the_generated_one():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert format_policies_markdown() in readme, (
        "README.md's policy table is out of date: paste the output of "
        "`python -m dtralloc config --policies`"
    )


def test_readme_holds_the_install_and_test_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "pip install torch==2.13.0 && pip install . && dtralloc demo" in readme
    assert 'pip install ".[test]" && python -m pytest' in readme
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert "python -m pytest" in f.read()
