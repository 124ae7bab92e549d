package main

import (
	"bytes"
	"regexp"
	"testing"
)

// TestPrintWorkersRoles: workers list shows each worker's P/D role (an
// older tetherd that sends none: regular).
func TestPrintWorkersRoles(t *testing.T) {
	body := []byte(`{"workers":[
		{"slot":0,"url":"http://p:1","state":"healthy","healthy":true,"origin":"config","role":"prefill"},
		{"slot":1,"url":"http://d:1","state":"healthy","healthy":true,"origin":"config","role":"decode"},
		{"slot":2,"url":"http://r:1","state":"healthy","healthy":true,"origin":"admin"}],"total":3,"healthy":3}`)
	var out bytes.Buffer
	if err := printWorkers(&out, body); err != nil {
		t.Fatal(err)
	}
	for _, re := range []string{`(?m)^SLOT\s+STATE\s+HEALTHY\s+ROLE\s`, `(?m)^0\s+healthy\s+true\s+prefill\s.*http://p:1$`,
		`(?m)^1\s+healthy\s+true\s+decode\s.*http://d:1$`, `(?m)^2\s+healthy\s+true\s+regular\s.*http://r:1$`} {
		if !regexp.MustCompile(re).Match(out.Bytes()) {
			t.Errorf("no %s in\n%s", re, out.String())
		}
	}
}
