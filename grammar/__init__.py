"""The grammar of .zs files, shipped as package data."""
