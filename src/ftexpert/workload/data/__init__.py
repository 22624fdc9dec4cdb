"""The bundled corpus (kjv.txt.xz) and the script that made it; README.md has its source and licence."""
