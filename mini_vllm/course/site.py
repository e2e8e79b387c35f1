"""``make site``: the course as a static website in ``build/site/``, built without executing anything.

Every chapter (``notebooks/``, Appendix A included) and every exercise
(``exercises/``) becomes one HTML page with its committed outputs, through
nbconvert's HTML exporter and its ``lab`` template, plus ``index.html``: the
chapters in order with their titles, the exercises, and how to open the course
in JupyterLab or on Binder. Each page has a navigation bar (index, previous,
next; an exercise also links its chapter), and links between notebooks
(``../exercises/02_paged_pool.ipynb``) point at the built pages.

Nothing on a page comes from a CDN. The scripts nbconvert's pages load are
copied into ``_static/`` from the npm registry's packages, fetched with ``npm
pack`` at build time (pinned versions, checked against the registry's
SHA-512, cached in ``build/npm-cache/``, so a second build needs no network):

* ``@jupyter-widgets/html-manager`` (``dist/embed-amd.js``): renders a widget
  from the state saved in a notebook's metadata (ipywidgets 8);
* ``requirejs``: ``embed-amd.js`` is an AMD module;
* ``mathjax`` 2.7 (what nbconvert's template configures): the chapters' formulas.

Widgets: the committed notebooks keep no widget state (``make notebooks``
strips it, ``mini_vllm.course.build.clean_for_commit``), and every widget of
``mini_vllm.viz`` carries a static HTML snapshot next to its live view. Before
a notebook is exported, ``keep_restorable_widgets`` (the same function as
``make lab``'s pre-save hook) drops every widget view whose state is not saved,
so an output shows the live widget rendered from saved state when there is
one, and its static snapshot otherwise: never "Error displaying widget".

    python -m mini_vllm.course.site [--out DIR] [--binder-repo OWNER/NAME]
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import nbformat

from .build import ROOT
from .lab import START_NOTEBOOK, keep_restorable_widgets

SITE_DIR = ROOT / "build" / "site"
NPM_CACHE = ROOT / "build" / "npm-cache"
STATIC = "_static"
CHAPTER_GLOB = "[0-9A-Z][0-9_]*.ipynb"  # the Makefile's NOTEBOOKS glob: chapters 00 … 10 and Appendix A
BINDER_URL = "https://mybinder.org/v2/gh/{repo}/HEAD?urlpath=lab/tree/" + START_NOTEBOOK


@dataclass(frozen=True)
class NpmPackage:
    name: str
    version: str
    integrity: str  # the registry's dist.integrity (`npm view NAME@VERSION dist.integrity`)

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def tarball_name(self) -> str:
        """The file ``npm pack`` writes: ``@scope/name`` -> ``scope-name-VERSION.tgz``."""
        return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}.tgz"


# html-manager 1.x renders ipywidgets 8 (widget protocol 2), the version pyproject asks for.
HTML_MANAGER = NpmPackage(
    "@jupyter-widgets/html-manager",
    "1.0.15",
    "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
)
REQUIREJS = NpmPackage(
    "requirejs",
    "2.3.8",
    "sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw==",
)
# MathJax 2, as nbconvert's template configures it (MathJax.Hub.Config); never its latest.js,
# which loads the newest 2.x from a CDN.
MATHJAX = NpmPackage(
    "mathjax",
    "2.7.7",
    "sha512-OOl0B2/0tSJAtAZarXnQuLDBLgTNRqiI9VqHTQzPsxf4okT2iIpDrvaklK9x2QEMD1sDj4yRn11Ygci41DxMAQ==",
)
NPM_PACKAGES = (HTML_MANAGER, REQUIREJS, MATHJAX)

# The files of each package the pages need: glob patterns inside the tarball's package/ folder
# (``*`` crosses folders). MathJax is 71 MB unpacked; CommonHTML output with the TeX fonts as
# woff is all nbconvert's configuration uses (~4 MB). html-manager: embed-amd.js and the font
# files its CSS names (not embed.js, libembed-amd.js or source maps).
STATIC_FILES = {
    HTML_MANAGER: ("package.json", "dist/embed-amd.js", "dist/*.LICENSE.txt")
    + tuple(f"dist/*.{ext}" for ext in ("woff2", "woff", "ttf", "eot", "svg")),
    REQUIREJS: ("package.json", "require.js"),
    MATHJAX: (
        "package.json",
        "LICENSE",
        "MathJax.js",
        "config/TeX-AMS_CHTML-full.js",
        "config/Safe.js",
        "extensions/*",
        "jax/input/TeX/*",
        "jax/output/CommonHTML/*",
        "jax/output/PreviewHTML/*",
        "jax/element/*",
        "fonts/HTML-CSS/TeX/woff/*",
        "localization/en/*",
    ),
}
# The URLs of the copied scripts, relative to a page one folder deep (notebooks/, exercises/).
WIDGET_ASSETS = f"{STATIC}/html-manager/dist/"
WIDGET_RENDERER = f"{WIDGET_ASSETS}embed-amd.js"
REQUIRE_JS = f"{STATIC}/requirejs/require.js"
MATHJAX_JS = f"{STATIC}/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"

# nbconvert's lab template with the site's navigation; mermaid's loader (a CDN import, and the
# course has no mermaid diagrams: tests/course/test_site.py checks that) is left out.
PAGE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}
{%- if "widgets" in nb.metadata -%}
<script>
// embed-amd.js's AMD modules (@jupyter-widgets/base, …/controls) find their fonts next to their own
// module path, which RequireJS puts below the page's folder unless told where they lie.
require.config({paths: {"@jupyter-widgets": "{{ resources.site_widget_assets }}"}});
</script>
{%- endif -%}
{{ super() }}
{%- endblock jupyter_widgets -%}
{%- block html_head_css -%}<style type="text/css">{{ resources.site_css }}</style>{%- endblock html_head_css -%}
{%- block body_header -%}
{{ super() }}
{{ resources.site_nav_top }}
{%- endblock body_header -%}
{% block body_footer %}
{{ resources.site_nav_bottom }}
{{ super() }}
{% endblock body_footer %}
"""
TEMPLATE_NAME = "mini_vllm_site.html.j2"

SITE_CSS = """
.mv-site-nav { font-family: var(--jp-ui-font-family, sans-serif); font-size: 14px; display: flex;
  flex-wrap: wrap; gap: 0.4em 1.2em; align-items: baseline; padding: 8px 16px; margin: 0 0 8px 0;
  border-bottom: 1px solid #ddd; background: #f7f7f7; }
.mv-site-nav.mv-bottom { border-top: 1px solid #ddd; border-bottom: none; margin: 24px 0 0 0; }
.mv-site-nav a { text-decoration: none; }
.mv-site-nav .mv-spacer { flex: 1; }
"""


class SiteError(RuntimeError):
    """The site cannot be built here (npm missing, a download that does not match, …)."""


@dataclass(frozen=True)
class Page:
    source: Path  # the notebook
    kind: str  # "chapter" or "exercise"
    title: str

    @property
    def href(self) -> str:
        """Where the page lies, relative to the site's root: ``notebooks/02_paged_pool.html``."""
        return f"{self.source.parent.name}/{self.source.stem}.html"

    @property
    def number(self) -> str:
        """``09b_sharing_a_cache_safely`` -> ``09b``; ``A_from_mini_vllm_to_vllm`` -> ``A``."""
        return self.source.stem.split("_", 1)[0]


# -- the npm packages ------------------------------------------------------------------
def _integrity_of(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def fetch_npm_package(package: NpmPackage, cache: Path = NPM_CACHE) -> Path:
    """The package's tarball in ``cache``: fetched with ``npm pack`` once, checked against its integrity."""
    tarball = cache / package.tarball_name
    if tarball.exists() and _integrity_of(tarball) == package.integrity:
        return tarball
    npm = shutil.which("npm")
    if npm is None:
        raise SiteError(
            f"npm is not installed: `make site` fetches {package.spec} from the npm registry with `npm pack` "
            "(Debian/Ubuntu: apt-get install npm; macOS: brew install node)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run(
            [npm, "pack", package.spec, "--pack-destination", tmp, "--silent"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        fetched = Path(tmp) / package.tarball_name
        if done.returncode != 0 or not fetched.exists():
            raise SiteError(f"npm pack {package.spec} failed: {(done.stderr or done.stdout).strip()[-800:]}")
        found = _integrity_of(fetched)
        if found != package.integrity:
            raise SiteError(f"{package.spec}: the download's integrity {found} is not the pinned {package.integrity}")
        fetched.replace(tarball)
    return tarball


def _wanted(member: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(member, pattern) for pattern in patterns)


def install_static(static_dir: Path, cache: Path = NPM_CACHE) -> list[Path]:
    """Unpack what the pages load from each npm package into ``static_dir/<package>/``; returns the files."""
    written = []
    for package, wanted in STATIC_FILES.items():
        target = static_dir / package.name.split("/")[-1]
        unpacked = []
        with tarfile.open(fetch_npm_package(package, cache)) as archive:
            for member in archive.getmembers():
                relative = PurePosixPath(member.name)
                if not member.isfile() or relative.parts[0] != "package" or ".." in relative.parts:
                    continue
                inner = str(PurePosixPath(*relative.parts[1:]))
                if not _wanted(inner, wanted):
                    continue
                path = target / inner
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.extractfile(member).read())
                unpacked.append(inner)
        missing = [w for w in wanted if not any(_wanted(inner, (w,)) for inner in unpacked)]
        if missing:
            raise SiteError(f"{package.spec} has none of {missing}")
        written += [target / inner for inner in unpacked]
    return written


# -- the pages -------------------------------------------------------------------------
def notebook_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The first markdown heading, as plain text: ``# 02 · The paged pool: `KVCacheBlock` …`` -> ``02 · The paged pool: KVCacheBlock …``."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if line.startswith("#"):
                text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())  # [text](link) -> text
                return text.replace("`", "").replace("**", "").strip() or fallback
    return fallback


def course_pages(root: Path = ROOT) -> list[Page]:
    """Every chapter in the Makefile's order, then every exercise."""
    found = [(p, "chapter") for p in sorted((root / "notebooks").glob(CHAPTER_GLOB))]
    found += [(p, "exercise") for p in sorted((root / "exercises").glob("*.ipynb"))]
    return [Page(path, kind, notebook_title(nbformat.read(path, as_version=4), path.stem)) for path, kind in found]


def _link(href: str, label: str, rel: str = "") -> str:
    rel_attr = f' rel="{rel}"' if rel else ""
    return f'<a href="{html.escape(href)}"{rel_attr}>{html.escape(label)}</a>'


def page_navigation(page: Page, pages: list[Page]) -> tuple[str, str]:
    """The bars at the top and the bottom of ``page``: index, previous and next of the same kind, its chapter."""
    same = [p for p in pages if p.kind == page.kind]
    i = same.index(page)
    up = "../"  # every page lies one folder deep
    items = [_link(up + "index.html", "mini-vLLM course: index")]
    if page.kind == "exercise":
        chapter = next((p for p in pages if p.kind == "chapter" and p.number == page.number), None)
        if chapter is not None:
            items.append(_link(up + chapter.href, f"chapter {chapter.number}"))
    else:
        exercise = next((p for p in pages if p.kind == "exercise" and p.number == page.number), None)
        if exercise is not None:
            items.append(_link(up + exercise.href, f"exercise {exercise.number}"))
    items.append('<span class="mv-spacer"></span>')
    if i > 0:
        items.append("‹ " + _link(up + same[i - 1].href, same[i - 1].title, "prev"))
    if i + 1 < len(same):
        items.append(_link(up + same[i + 1].href, same[i + 1].title, "next") + " ›")
    body = "\n  ".join(items)
    return (
        f'<nav class="mv-site-nav mv-top" aria-label="course">\n  {body}\n</nav>',
        f'<nav class="mv-site-nav mv-bottom" aria-label="course">\n  {body}\n</nav>',
    )


def make_exporter():
    """nbconvert's HTML exporter, lab template, every script URL local (pages lie one folder deep)."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    return HTMLExporter(
        template_name="lab",
        template_file=TEMPLATE_NAME,
        extra_loaders=[DictLoader({TEMPLATE_NAME: PAGE_TEMPLATE})],
        require_js_url=f"../{REQUIRE_JS}",
        widget_renderer_url=f"../{WIDGET_RENDERER}",
        jupyter_widgets_base_url=f"../{STATIC}/",
        mathjax_url=f"../{MATHJAX_JS}",
    )


_IPYNB_HREF = re.compile(r'href="([^":#?]+)\.ipynb((?:#[^"]*)?)"')


def rewrite_notebook_links(page_html: str, page_href: str, built: set[str]) -> str:
    """``href="../exercises/02_x.ipynb"`` -> ``…/02_x.html`` where that page is built (others stay as they are)."""
    folder = PurePosixPath(page_href).parent

    def replace(match: re.Match) -> str:
        target = os.path.normpath(str(folder / f"{match.group(1)}.html")).replace(os.sep, "/")
        if target in built:
            return f'href="{match.group(1)}.html{match.group(2)}"'
        return match.group(0)

    return _IPYNB_HREF.sub(replace, page_html)


def render_page(page: Page, pages: list[Page], exporter) -> str:
    nb = nbformat.read(page.source, as_version=4)
    keep_restorable_widgets(nb)  # a widget view without saved state: its static snapshot instead
    nb.metadata["title"] = page.title
    top, bottom = page_navigation(page, pages)
    resources = {
        "site_nav_top": top,
        "site_nav_bottom": bottom,
        "site_css": SITE_CSS,
        # where RequireJS finds @jupyter-widgets/*, so that embed-amd.js loads its fonts from there
        "site_widget_assets": f"../{WIDGET_ASSETS}".rstrip("/"),
    }
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return rewrite_notebook_links(body, page.href, {p.href for p in pages})


def index_html(pages: list[Page], binder_repo: str | None = None) -> str:
    """The start page: chapters in order, exercises, and where to run the course."""

    def listing(kind: str) -> str:
        return "\n".join(f"  <li>{_link(p.href, p.title)}</li>" for p in pages if p.kind == kind)

    if binder_repo:
        binder = f"<p>{_link(BINDER_URL.format(repo=binder_repo), 'Open the course on Binder')} (CPU only).</p>"
    else:
        binder = (
            "<p>On <a href='https://mybinder.org'>mybinder.org</a>: enter this repository's GitHub address and "
            f"<code>lab/tree/{html.escape(START_NOTEBOOK)}</code> as the path to open; the repository's "
            "<code>binder/</code> folder sets it up.</p>"
        )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8" />
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>mini-vLLM: learn prefix caching by building it</title>
<style type="text/css">
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 52em; margin: 2em auto;
  padding: 0 1em; line-height: 1.5; color: #222; }}
code, pre {{ font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 0.92em; }}
pre {{ background: #f5f5f5; padding: 0.6em 0.8em; }}
li {{ margin: 0.15em 0; }}
</style>
</head>
<body>
<main>
<h1>mini-vLLM: learn prefix caching by building it</h1>
<p>An interactive notebook course that builds a compact vLLM-style inference engine, chapter by chapter:
paged KV-cache blocks, chained block hashes, prefix hits, reference counts, LRU eviction, a scheduler,
Triton kernels and a real small model. These pages show every chapter and exercise with the outputs
saved in the repository; nothing here runs. To run them, open the course in JupyterLab.</p>

<h2 id="chapters">Chapters</h2>
<ol>
{listing("chapter")}
</ol>

<h2 id="exercises">Exercises</h2>
<p>Each exercise is a stub with check cells; its filled-in twin is in <code>solutions/</code>.</p>
<ul>
{listing("exercise")}
</ul>

<h2 id="run">Open in JupyterLab or on Binder</h2>
<p>On your machine (Python ≥ 3.10), from a clone of the repository:</p>
<pre>make lab</pre>
<p>installs the course into <code>.venv</code>, copies every notebook into <code>my-course/</code> (your
working copy) and opens <code>{html.escape(START_NOTEBOOK)}</code> in JupyterLab.</p>
{binder}
<p>A VS Code dev container or GitHub Codespace works too: <code>.devcontainer/</code> installs the same
environment. The README's section “Where it runs” says which chapters fit where (the real model and real vLLM
need more memory than Binder gives).</p>
</main>
</body>
</html>
"""


def build_site(out: Path = SITE_DIR, binder_repo: str | None = None, root: Path = ROOT) -> list[Path]:
    """Write the whole site into ``out`` (emptied first); returns the HTML pages written, index first."""
    pages = course_pages(root)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    install_static(out / STATIC)
    exporter = make_exporter()
    written = [out / "index.html"]
    written[0].write_text(index_html(pages, binder_repo), encoding="utf-8")
    for page in pages:
        target = out / page.href
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render_page(page, pages, exporter), encoding="utf-8")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.course.site", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SITE_DIR, help=f"default: {SITE_DIR}")
    parser.add_argument("--binder-repo", default=None, help="OWNER/NAME on GitHub: the index links its Binder")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        written = build_site(args.out, args.binder_repo)
    except SiteError as err:
        print(f"make site: {err}", file=sys.stderr)
        return 1
    print(f"make site: {len(written)} pages in {args.out} ({time.monotonic() - start:.1f} s); open {written[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
