// SPDX-License-Identifier: MIT
//
// node syntax_check.js FILE.jl...  -- parses Julia files with tree-sitter-julia and reports every syntax error
// (ERROR or MISSING node) with its line; exit status 1 if any. A parse check only: it does not resolve names or
// types (Julia is not available where libdion is built). Run by ../ci.sh with the packages of package.json.
'use strict';
const fs = require('fs');
const Parser = require('tree-sitter');
const Julia = require('tree-sitter-julia');

const parser = new Parser();
parser.setLanguage(Julia);
let bad = 0;
for (const file of process.argv.slice(2)) {
  const src = fs.readFileSync(file, 'utf8');
  const tree = parser.parse((i) => src.slice(i, i + 4096));
  const errors = [];
  (function walk(node) {
    if (node.type === 'ERROR' || node.isMissing) errors.push(node);
    else if (node.hasError) for (const child of node.children) walk(child);
  })(tree.rootNode);
  for (const e of errors.slice(0, 20)) {
    const text = src.slice(e.startIndex, Math.min(e.endIndex, e.startIndex + 80)).replace(/\n/g, '\\n');
    console.log(`${file}:${e.startPosition.row + 1}:${e.startPosition.column + 1}: ` +
                `${e.isMissing ? 'missing ' + e.type : 'syntax error'}: ${text}`);
  }
  console.log(`${file}: ${errors.length ? errors.length + ' syntax error(s)' : 'parses'}`);
  bad += errors.length;
}
process.exit(bad ? 1 : 0);
