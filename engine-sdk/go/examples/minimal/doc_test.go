package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The engine docs/engines-in-go.md shows is this file, word for word.
func TestTheDocsShowThisEngine(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "..", "..", "docs", "engines-in-go.md"))
	if err != nil {
		t.Fatal(err)
	}
	code, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	_, block, found := strings.Cut(string(doc), "```go\n")
	block, _, closed := strings.Cut(block, "```\n")
	if !found || !closed {
		t.Fatal("docs/engines-in-go.md has no ```go block")
	}
	if block != string(code) {
		t.Fatal("docs/engines-in-go.md's engine differs from examples/minimal/main.go: copy main.go into the doc")
	}
}
