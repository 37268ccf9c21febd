package contract

import (
	"path/filepath"
	"strings"
	"testing"
)

// The shared vectors' folder, from this package's directory.
var testdata = filepath.Join("..", "..", "..", "proto", "testdata")

func TestEveryRequestVectorIsAcceptedOrRefusedAsItSays(t *testing.T) {
	cases, err := LoadVectors(filepath.Join(testdata, "requests.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) < 40 {
		t.Fatalf("only %d request vectors: are they all there?", len(cases))
	}
	var problems []string
	for _, c := range cases {
		if d := c.Disagreement(CheckRequest(c.Message)); d != "" {
			problems = append(problems, d)
		}
	}
	if len(problems) > 0 {
		t.Fatal(strings.Join(problems, "\n"))
	}
}

func TestEveryResultVectorIsAcceptedOrRefusedAsItSays(t *testing.T) {
	cases, err := LoadVectors(filepath.Join(testdata, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) < 30 {
		t.Fatalf("only %d result vectors: are they all there?", len(cases))
	}
	var problems []string
	for _, c := range cases {
		if d := c.Disagreement(c.CheckResult()); d != "" {
			problems = append(problems, d)
		}
	}
	if len(problems) > 0 {
		t.Fatal(strings.Join(problems, "\n"))
	}
}
