"""Folded stacks as an interactive flame graph: one SVG file that a browser opens from disk.

Brendan Gregg's flame graph: each frame a box whose width is its share of the samples
(here: hits), its callers below it, the outermost frame (``all``) at the bottom; boxes of one
parent ordered by name, so that equal stacks merge and the picture does not depend on the
order of the hits. The file holds everything it needs, with no request to anywhere:

* each frame is a ``<g>`` with a ``<title>`` (the tooltip: name, hits, share), a ``<rect>``
  and a ``<text>``, its place in hits (``data-x``, ``data-w``) and depth (``data-d``) kept as
  attributes, so that the script can lay it out again;
* a small script (written here, in our own words) fits each name in its box (``..`` when
  cut), zooms on a click (the frame fills the width, its callers stay below it, faded; a
  click on ``all`` or "Reset zoom" undoes it), and searches: "Search" (or Ctrl-F) asks for
  a regular expression, paints the matching frames and says their share of the hits;
  ``FILE.svg?zoom=NAME&s=REGEX`` opens it zoomed and searched (flamegraph.pl's ``?s=``).

Rejected: drawing on a ``<canvas>`` (the names would not be in the document: neither
searchable with the browser's find nor checkable in a test), and linking d3-flame-graph from
a CDN (the file would not open offline).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from xml.sax.saxutils import escape, quoteattr

from kprobes.values import dataclass, field

WIDTH = 1200
FRAME_HEIGHT = 16
FONT_SIZE = 12
_TOP = 50  # room for the title and the buttons
_BOTTOM = 34  # room for the details line


@dataclass(slots=True)
class _Node:
    name: str
    value: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _tree(folded: Iterable[tuple[tuple[str, ...], int]]) -> _Node:
    root = _Node("all")
    for names, count in folded:
        node = root
        node.value += count
        for name in names:
            node = node.children.setdefault(name, _Node(name))
            node.value += count
    return root


def _depth(node: _Node) -> int:
    return 1 + max((_depth(child) for child in node.children.values()), default=0)


def _color(name: str) -> str:
    """A warm colour that stays the same for a name from one graph to the next."""
    h = zlib.crc32(name.encode())
    red = 205 + h % 50
    green = (h >> 8) % 180
    blue = (h >> 16) % 55
    return f"rgb({red},{green},{blue})"


def _frames(root: _Node, height: int) -> list[str]:
    """A ``<g>`` per frame, laid out for the whole graph (the script lays them out again)."""
    total = max(root.value, 1)
    scale = (WIDTH - 20) / total
    out: list[str] = []
    todo: list[tuple[_Node, int, int]] = [(root, 0, 0)]  # node, x in hits, depth
    while todo:
        node, x, depth = todo.pop()
        y = height - _BOTTOM - (depth + 1) * FRAME_HEIGHT
        share = 100 * node.value / total
        hits = "hit" if node.value == 1 else "hits"
        tip = f"{node.name} ({node.value:,} {hits}, {share:.2f}%)"
        out.append(
            f'<g class="f" data-x="{x}" data-w="{node.value}" data-d="{depth}">'
            f"<title>{escape(tip)}</title>"
            f'<rect x="{10 + x * scale:.1f}" y="{y}" width="{node.value * scale:.1f}" '
            f'height="{FRAME_HEIGHT - 1}" fill="{_color(node.name)}" rx="2"/>'
            f'<text x="{13 + x * scale:.1f}" y="{y + FRAME_HEIGHT - 4}" '
            f"data-n={quoteattr(node.name)}>{escape(node.name)}</text></g>"
        )
        child_x = x
        for name in sorted(node.children):
            child = node.children[name]
            todo.append((child, child_x, depth + 1))
            child_x += child.value
    return out


def flame_graph_svg(folded: Iterable[tuple[tuple[str, ...], int]], title: str) -> str:
    """The SVG document of the folded stacks ``(names outermost first, count)``."""
    root = _tree(folded)
    height = _TOP + _depth(root) * FRAME_HEIGHT + _BOTTOM
    frames = "\n".join(_frames(root, height))
    return f"""<?xml version="1.0" standalone="no"?>
<svg version="1.1" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" \
viewBox="0 0 {WIDTH} {height}" data-total="{root.value}" data-width="{WIDTH - 20}">
<style>
text {{ font-family: Verdana, sans-serif; font-size: {FONT_SIZE}px; fill: #000; }}
.f text {{ pointer-events: none; }}
.f:hover rect {{ stroke: #000; stroke-width: 0.5; }}
.button {{ cursor: pointer; fill: #33c; }}
#title {{ font-size: 17px; text-anchor: middle; }}
</style>
<rect width="100%" height="100%" fill="#f8f8f0"/>
<text id="title" x="{WIDTH // 2}" y="24">{escape(title)}</text>
<text id="reset" class="button" x="10" y="24" visibility="hidden">Reset zoom</text>
<text id="search" class="button" x="{WIDTH - 120}" y="24">Search</text>
<text id="matched" x="{WIDTH - 120}" y="{height - 12}"></text>
<text id="details" x="10" y="{height - 12}"> </text>
<g id="frames">
{frames}
</g>
<script type="text/ecmascript"><![CDATA[
{_SCRIPT}
]]></script>
</svg>
"""


# The graph's behaviour: fit names, zoom, search. Frames keep their place in hits in data-*
# attributes; a view is the range [x0, x0 + w0) of hits shown across the width, from depth d0.
_SCRIPT = """
(function () {
  var svg = document.documentElement;
  var total = +svg.getAttribute('data-total') || 1, width = +svg.getAttribute('data-width');
  var frames = Array.prototype.slice.call(document.querySelectorAll('g.f'));
  var details = document.getElementById('details'), reset = document.getElementById('reset');
  var matched = document.getElementById('matched'), search = document.getElementById('search');
  var charWidth = 0.59 * FONT;

  function fit(g, w) {
    var text = g.querySelector('text'), name = text.getAttribute('data-n');
    var room = Math.floor((w - 6) / charWidth);
    if (room >= name.length) text.textContent = name;
    else text.textContent = room < 3 ? '' : name.slice(0, room - 2) + '..';
  }

  function show(x0, w0, d0) {
    frames.forEach(function (g) {
      var x = +g.getAttribute('data-x'), w = +g.getAttribute('data-w');
      var d = +g.getAttribute('data-d'), rect = g.querySelector('rect');
      var text = g.querySelector('text'), px, pw;
      if (d < d0) {  // below the zoomed frame: its callers, at full width
        var holds = x <= x0 && x0 + w0 <= x + w;
        px = 0; pw = width; g.style.opacity = holds ? 0.5 : 1;
        g.style.display = holds ? '' : 'none';
      } else if (x0 <= x && x + w <= x0 + w0) {
        px = (x - x0) / w0 * width; pw = w / w0 * width; g.style.opacity = 1;
        g.style.display = '';
      } else {
        g.style.display = 'none'; return;
      }
      rect.setAttribute('x', 10 + px); rect.setAttribute('width', pw);
      text.setAttribute('x', 13 + px);
      fit(g, pw);
    });
    reset.setAttribute('visibility', w0 < total || d0 > 0 ? 'visible' : 'hidden');
  }

  frames.forEach(function (g) {
    g.addEventListener('click', function () {
      var d = +g.getAttribute('data-d');
      if (d === 0) { show(0, total, 0); return; }
      show(+g.getAttribute('data-x'), +g.getAttribute('data-w'), d);
    });
    g.addEventListener('mouseover', function () {
      details.textContent = g.querySelector('title').textContent;
    });
    g.addEventListener('mouseout', function () { details.textContent = ' '; });
  });
  reset.addEventListener('click', function () { show(0, total, 0); });

  function find(pattern) {
    var re, hits = 0, counted = [];
    try { re = new RegExp(pattern); } catch (e) { return; }
    frames.forEach(function (g) {
      var rect = g.querySelector('rect'), name = g.querySelector('text').getAttribute('data-n');
      if (!rect.hasAttribute('data-fill')) {
        rect.setAttribute('data-fill', rect.getAttribute('fill'));
      }
      var yes = pattern !== '' && re.test(name);
      rect.setAttribute('fill', yes ? 'rgb(230,0,230)' : rect.getAttribute('data-fill'));
      if (!yes) return;
      var x = +g.getAttribute('data-x'), w = +g.getAttribute('data-w');
      // A match inside another match is counted once (its hits are the outer one's).
      if (counted.some(function (r) { return r[0] <= x && x + w <= r[0] + r[1]; })) return;
      counted.push([x, w]); hits += w;
    });
    matched.textContent = pattern ? 'Matched: ' + (100 * hits / total).toFixed(1) + '%' : '';
    search.textContent = pattern ? 'Clear search' : 'Search';
  }

  search.addEventListener('click', function () {
    if (search.textContent !== 'Search') { find(''); return; }
    var pattern = window.prompt('Search for (a regular expression):', '');
    if (pattern) find(pattern);
  });
  window.addEventListener('keydown', function (e) {
    if ((e.ctrlKey || e.metaKey) && e.key === 'f') {
      e.preventDefault();
      search.dispatchEvent(new Event('click'));
    }
  });
  show(0, total, 0);
  // A view asked for in the address (file.svg?zoom=NAME&s=REGEX): zoomed on the first frame
  // named NAME, the frames REGEX matches painted (as flamegraph.pl's ?s=).
  var params = new URLSearchParams(window.location.search);
  var zoom = params.get('zoom'), pattern = params.get('s');
  if (zoom) {
    var target = frames.filter(function (g) {
      return g.querySelector('text').getAttribute('data-n') === zoom;
    })[0];
    if (target) target.dispatchEvent(new Event('click'));
  }
  if (pattern) find(pattern);
})();
""".replace("FONT", str(FONT_SIZE))
