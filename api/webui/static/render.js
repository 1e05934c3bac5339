// An answer's text as the page shows it: markdown made safe by DOMPurify, code highlighted by
// highlight.js. The libraries are built into vendor/ at install (build.py); without them every
// text is shown as plain text, escaped, and the page says so once.

let libraries = null; // {marked, purify, hljs} once loaded; false when vendor/ has none

export async function loadLibraries() {
  try {
    const [{marked}, {default: purify}, {default: hljs}] = await Promise.all([
      import("./vendor/marked.esm.js"),
      import("./vendor/purify.es.mjs"),
      import("./vendor/highlight.min.js"),
    ]);
    // Links open beside the page, telling the other site nothing of it.
    purify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A") node.setAttribute("rel", "noopener noreferrer");
      if (node.tagName === "A") node.setAttribute("target", "_blank");
    });
    libraries = {marked, purify, hljs};
  } catch {
    libraries = false;
  }
  return libraries !== false;
}

export function renderInto(element, text) {
  if (!libraries) {
    element.classList.add("plain");
    element.textContent = text;
    return;
  }
  element.innerHTML = libraries.purify.sanitize(libraries.marked.parse(text));
  for (const block of element.querySelectorAll("pre code")) libraries.hljs.highlightElement(block);
}
