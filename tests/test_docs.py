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


def test_readme_layout_names_every_room_of_the_package():
    """A room added to python/dtralloc or allocator/ gets its line in the README."""
    import re
    from pathlib import Path

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    layout = readme[readme.index("## Layout"):]
    layout = layout[: layout.index("```", layout.index("```") + 3)]
    words = set(re.findall(r"[\w/]+", layout))
    package = Path(ROOT, "python", "dtralloc")
    rooms = {p.parent.name + "/" for p in package.glob("*/__init__.py")}
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    native = {"allocator/" + p.name + "/" for p in Path(ROOT, "allocator").iterdir() if p.is_dir()}
    missing = sorted((rooms | modules | native) - words)
    assert not missing, f"README.md's Layout section does not name: {', '.join(missing)}"
