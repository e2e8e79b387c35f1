"""``make site``: the static site of the course (``mini_vllm/course/site.py``), built and opened in Chromium.

The site is built once into a temporary folder and served on a localhost port.
Headless Chromium (Debian's, as in ``tests/browser/``) opens every page with
every request outside that server recorded and refused. Each page must have
a title, log no JavaScript error, load nothing from elsewhere, get an answer to
every request, and show no widget error or placeholder ("Error displaying
widget", "Loading widget…") and no MathJax error; every relative link must
name a built file. A notebook with saved widget state (a real
``EngineDashboard``) checks that a live view is rendered from that state by
the bundled html-manager, and that a view without saved state shows the
widget's static snapshot. The checker functions are tested on pages made to
fail (a CDN script, a widget error, a dead link).

Needs npm (the build fetches the widget, RequireJS and MathJax scripts from
the npm registry, cached in build/npm-cache/) and Chromium with Playwright;
skipped with the reason without them, failed under CI (tests/prerequisites.py).
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

from mini_vllm.course import site
from prerequisites import CHROMIUM, missing, require_chromium

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# Text that must never be on a page: what JupyterLab, the html-manager and ipywidgets show
# when a widget cannot be rendered, and MathJax's error.
BAD_TEXT = (
    "Error displaying widget",
    "Loading widget",
    "model not found",
    "Widget Javascript not detected",
    "A Jupyter widget could not be displayed",
    "Math Processing Error",
)
MAX_BUILD_SECONDS = 120
MATH_CHAPTERS = ("01_kv_cache", "03_block_tables", "07_triton_kernels")  # their formulas must be typeset
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

pytestmark = pytest.mark.slow


# -- the checkers (tested below on pages made to fail) ---------------------------------
class _Resources(HTMLParser):
    """Every URL a page loads (script/img/iframe/source src, stylesheet/icon href) and every link (a href)."""

    LOADS = {"script": "src", "img": "src", "iframe": "src", "source": "src", "audio": "src", "video": "src"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.loads: list[str] = []
        self.links: list[str] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in self.LOADS and attrs.get(self.LOADS[tag]):
            self.loads.append(attrs[self.LOADS[tag]])
        elif tag == "link" and attrs.get("href"):
            self.loads.append(attrs["href"])
        elif tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _external(url: str) -> bool:
    return bool(re.match(r"(?i)^(https?:)?//", url.strip()))


def page_problems(page_html: str) -> list[str]:
    """What is wrong with a page's HTML: no title, a resource from another host, widget or MathJax error text."""
    parsed = _Resources()
    parsed.feed(page_html)
    problems = []
    if not parsed.title.strip():
        problems.append("no <title>")
    problems += [f"loads an external resource: {url}" for url in parsed.loads if _external(url)]
    problems += [
        f"CSS loads an external resource: {url}"
        for url in re.findall(r"""(?i)(?:@import\s+|url\(\s*)["']?((?:https?:)?//[^"')\s]+)""", page_html)
    ]
    problems += [f"shows {text!r}" for text in BAD_TEXT if text in page_html]
    return problems


def unresolved_links(page: Path, site_root: Path) -> list[str]:
    """The relative links and resources of ``page`` that name no file under ``site_root``."""
    parsed = _Resources()
    parsed.feed(page.read_text(encoding="utf-8"))
    bad = []
    for url in parsed.links + parsed.loads:
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or not parts.path:  # http(s), mailto, data:, a bare #anchor
            continue
        target = (page.parent / unquote(parts.path)).resolve()
        if not target.is_file() or site_root.resolve() not in target.parents:
            bad.append(url)
    return bad


# -- the browser -----------------------------------------------------------------------
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Server:
    """``folder`` on a free localhost port, in a thread."""

    def __init__(self, folder: Path) -> None:
        handler = functools.partial(_Quiet, directory=str(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Browser:
    """One headless Chromium; ``visit`` opens a page and returns what went wrong on it."""

    def __init__(self) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)

    def visit(self, url: str, base: str, wait_for: str | None = None) -> tuple[list[str], object]:
        """Open ``url``; every request outside ``base`` is refused and reported. Returns (problems, page)."""
        context = self.browser.new_context()
        problems: list[str] = []

        def route(route):
            if route.request.url.startswith(base) or route.request.url.startswith("data:"):
                route.continue_()
            else:
                problems.append(f"requested {route.request.url}")
                route.abort()

        context.route("**/*", route)
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
        page.on("pageerror", lambda err: problems.append(f"JavaScript error: {err}"))
        page.on(
            "requestfailed",
            lambda r: r.url.startswith(base) and problems.append(f"request failed: {r.url} ({r.failure})"),
        )
        page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
        page.goto(url, wait_until="load")
        if wait_for:
            page.wait_for_selector(wait_for, timeout=30_000)
        page.wait_for_load_state("networkidle")
        if not page.title().strip():
            problems.append("the page has no title")
        text = page.inner_text("body")
        problems += [f"shows {bad!r}" for bad in BAD_TEXT if bad in text]
        return problems, page

    def close(self) -> None:
        self.browser.close()
        self._playwright.stop()


# -- fixtures ----------------------------------------------------------------------------
def _static_or_skip(static_dir: Path) -> None:
    try:
        site.install_static(static_dir)
    except site.SiteError as err:
        missing("npm", f"make site cannot fetch its scripts: {err}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The whole site, built once; (folder, seconds the build took)."""
    out = tmp_path_factory.mktemp("site") / "site"
    _static_or_skip(tmp_path_factory.mktemp("static-probe"))  # fetched into build/npm-cache/ once
    start = time.monotonic()
    site.build_site(out)
    return out, time.monotonic() - start


@pytest.fixture(scope="module")
def browser():
    require_chromium()
    chromium = Browser()
    yield chromium
    chromium.close()


def _pages(folder: Path) -> list[Path]:
    return [folder / "index.html"] + sorted(folder.glob("notebooks/*.html")) + sorted(folder.glob("exercises/*.html"))


# -- the site ----------------------------------------------------------------------------
def test_every_chapter_and_exercise_is_built_in_time_and_indexed_in_order(built):
    folder, seconds = built
    assert seconds < MAX_BUILD_SECONDS, f"make site took {seconds:.0f} s"
    chapters = sorted((ROOT / "notebooks").glob(site.CHAPTER_GLOB))
    exercises = sorted((ROOT / "exercises").glob("*.ipynb"))
    assert chapters[-1].name.startswith("A_"), "Appendix A is a chapter page"
    for notebook in chapters + exercises:
        assert (folder / notebook.parent.name / f"{notebook.stem}.html").is_file(), notebook
    index = (folder / "index.html").read_text()
    positions = [index.index(f'href="notebooks/{c.stem}.html"') for c in chapters]
    assert positions == sorted(positions), "the index lists the chapters in the course's order"
    welcome = site.notebook_title(nbformat.read(chapters[0], as_version=4), "")
    assert welcome.startswith("00 · Welcome") and welcome in index.replace("&#x27;", "'")
    assert "make lab" in index and "Binder" in index


def test_every_page_is_self_contained_and_its_links_resolve(built):
    folder, _ = built
    for page in _pages(folder):
        assert not page_problems(page.read_text(encoding="utf-8")), (page.name, page_problems(page.read_text()))
        assert not unresolved_links(page, folder), (page.name, unresolved_links(page, folder))
    chapter = (folder / "notebooks" / "02_paged_pool.html").read_text()
    assert 'href="../exercises/02_paged_pool.html"' in chapter, "a chapter's link to its exercise is rewritten"
    assert 'rel="prev"' in chapter and 'rel="next"' in chapter


def test_every_page_renders_in_chromium(built, browser):
    folder, _ = built
    server = Server(folder)
    try:
        for page_path in _pages(folder):
            url = server.url + page_path.relative_to(folder).as_posix()
            problems, page = browser.visit(url, server.url)
            assert not problems, (page_path.name, problems)
            if page_path.parent.name == "notebooks" and page_path.stem in MATH_CHAPTERS:
                assert page.locator(".MathJax_CHTML").count() > 0, f"{page_path.name}: the formulas are not typeset"
            page.context.close()
    finally:
        server.close()


def test_no_notebook_has_a_mermaid_diagram():
    """The site's template leaves out nbconvert's mermaid loader (a CDN import): keep it unneeded."""
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "exercises").glob("*.ipynb")):
        assert "```mermaid" not in notebook.read_text(), notebook.name


# -- widgets: the live view from saved state, the snapshot without it --------------------
def _dashboard_notebook() -> nbformat.NotebookNode:
    """Three outputs of a real EngineDashboard: with saved state, without it, and a bare view without it."""
    import ipywidgets

    from mini_vllm import LLM
    from mini_vllm.viz import EngineDashboard

    dashboard = EngineDashboard(LLM(num_blocks=32))
    saved = dashboard._repr_mimebundle_()
    state = ipywidgets.Widget.get_manager_state(drop_defaults=True, widgets=None)
    unsaved = dict(saved, **{WIDGET_VIEW: dict(saved[WIDGET_VIEW], model_id="0" * 32)})
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {WIDGET_STATE: json.loads(json.dumps(state))}
    outputs = [
        nbformat.v4.new_output("display_data", data=saved),
        nbformat.v4.new_output("display_data", data=unsaved),
        nbformat.v4.new_output("display_data", data={WIDGET_VIEW: unsaved[WIDGET_VIEW]}),
    ]
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 99 · Widgets"),
        nbformat.v4.new_code_cell("dashboard", outputs=outputs),
    ]
    dashboard.close()
    return nb


def test_saved_widget_state_renders_live_and_a_view_without_it_shows_the_snapshot(tmp_path, browser):
    _static_or_skip(tmp_path / site.STATIC)
    nb = _dashboard_notebook()
    (tmp_path / "notebooks").mkdir()
    source = tmp_path / "notebooks" / "99_widgets.ipynb"
    nbformat.write(nb, source)
    page = site.Page(source, "chapter", "99 · Widgets")
    html_text = site.render_page(page, [page], site.make_exporter())
    assert "embed-amd.js" in html_text and not page_problems(html_text)
    (tmp_path / "index.html").write_text(site.index_html([page]))
    (tmp_path / page.href).write_text(html_text)
    server = Server(tmp_path)
    try:
        problems, browser_page = browser.visit(server.url + page.href, server.url, wait_for=".widget-html-content")
        assert not problems, problems
        live = browser_page.locator(".jp-OutputArea-output .widget-html-content")
        assert live.count() == 1, "the output with saved state is the live widget, rendered from that state"
        assert "EngineDashboard" in live.inner_text() or "blocks in use" in live.inner_text()
        assert browser_page.locator(".jupyter-widgets button").count() == 3  # Step, Run, Reset cache
        snapshots = browser_page.locator(".jp-OutputArea-output .mv-dashboard")
        assert snapshots.count() >= 1, "the view without saved state shows the dashboard's static snapshot"
        outputs = browser_page.locator(".jp-OutputArea-output")
        assert outputs.count() == 2, "the bare view without state is dropped, not shown as an error"
        browser_page.context.close()
    finally:
        server.close()


# -- the checkers can fail ---------------------------------------------------------------
GOOD_PAGE = '<html><head><title>t</title><script src="../_static/x.js"></script></head><body>ok</body></html>'


def test_page_problems_flags_cdn_scripts_widget_errors_and_a_missing_title():
    assert page_problems(GOOD_PAGE) == []
    cdn = GOOD_PAGE.replace("../_static/x.js", "https://cdn.jsdelivr.net/npm/x/embed-amd.js")
    assert page_problems(cdn) == ["loads an external resource: https://cdn.jsdelivr.net/npm/x/embed-amd.js"]
    css = GOOD_PAGE.replace("ok", "<style>@import url('https://fonts.googleapis.com/css?family=X');</style>")
    assert page_problems(css) == ["CSS loads an external resource: https://fonts.googleapis.com/css?family=X"]
    protocol_relative = GOOD_PAGE.replace("ok", '<link rel="stylesheet" href="//unpkg.com/x.css">')
    assert page_problems(protocol_relative) == ["loads an external resource: //unpkg.com/x.css"]
    error = GOOD_PAGE.replace("ok", "<div>Error displaying widget: model not found</div>")
    assert page_problems(error) == ["shows 'Error displaying widget'", "shows 'model not found'"]
    assert page_problems(GOOD_PAGE.replace("<title>t</title>", "<title> </title>")) == ["no <title>"]
    link_only = GOOD_PAGE.replace("ok", '<a href="https://mybinder.org">Binder</a>')
    assert page_problems(link_only) == [], "a link to another site is not a resource the page loads"


def test_unresolved_links_flags_a_dead_relative_link(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01.html").write_text("x")
    page = tmp_path / "notebooks" / "00.html"
    page.write_text(
        '<a href="01.html#top">next</a> <a href="02.html">gone</a> <a href="https://x.org">web</a>'
        ' <a href="#a">anchor</a> <a href="../../outside.html">out</a> <img src="../_static/missing.png">'
    )
    assert unresolved_links(page, tmp_path) == ["02.html", "../../outside.html", "../_static/missing.png"]


def test_links_between_notebooks_point_at_the_built_pages():
    body = '<a href="../exercises/02_x.ipynb#check">e</a> <a href="../solutions/02_x.ipynb">s</a>'
    built = {"notebooks/02_x.html", "exercises/02_x.html"}
    assert site.rewrite_notebook_links(body, "notebooks/02_x.html", built) == (
        '<a href="../exercises/02_x.html#check">e</a> <a href="../solutions/02_x.ipynb">s</a>'
    )  # the solution is not built: its link stays and the test above would flag it


def test_navigation_runs_through_the_chapters_and_links_an_exercise_to_its_chapter(tmp_path):
    def page(folder, stem, kind):
        return site.Page(tmp_path / folder / f"{stem}.ipynb", kind, f"{stem} title")

    pages = [page("notebooks", "00_a", "chapter"), page("notebooks", "01_b", "chapter")]
    pages += [page("exercises", "01_b", "exercise")]
    top, bottom = site.page_navigation(pages[0], pages)
    assert 'rel="prev"' not in top and 'href="../notebooks/01_b.html" rel="next"' in top and "mv-bottom" in bottom
    top, _ = site.page_navigation(pages[1], pages)
    assert 'href="../notebooks/00_a.html" rel="prev"' in top and 'rel="next"' not in top
    assert 'href="../exercises/01_b.html">exercise 01' in top
    top, _ = site.page_navigation(pages[2], pages)
    assert 'href="../notebooks/01_b.html">chapter 01' in top and 'rel="prev"' not in top


def test_titles_are_the_first_heading_without_markdown():
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_markdown_cell("intro\n# 03 · Block tables and `slot_mapping`")]
    )
    assert site.notebook_title(nb, "x") == "03 · Block tables and slot_mapping"
    assert site.notebook_title(nbformat.v4.new_notebook(), "fallback") == "fallback"


def test_a_tarball_that_does_not_match_its_integrity_is_refused(tmp_path, monkeypatch):
    fake = site.NpmPackage("requirejs", "2.3.8", "sha512-AAAA")
    (tmp_path / fake.tarball_name).write_bytes(b"not the package")
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm: the cached file does not match, nothing to fetch with
    with pytest.raises(site.SiteError, match="npm is not installed"):
        site.fetch_npm_package(fake, tmp_path)
