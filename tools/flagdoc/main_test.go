package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const help = "Usage of tetherd:\n" +
	"  -admin string\n    \tadmin API address; \"off\": none (default \"127.0.0.1:8081\")\n" +
	"  -io-uring\n    \tbatch through an io_uring (default true)\n" +
	"  -listeners int\n    \tlisteners (default: one per CPU)\n" +
	"  -max-conns int\n    \tmost connections | at once\n" +
	"  -worker value\n    \tbackend worker URL <repeatable>\n"

const doc = "# tetherd\n\n<!-- flagdoc:table -->\nstale\n<!-- /flagdoc -->\n\nlimits:\n\n" +
	"<!-- flagdoc:rows -->\n| flag | default | trips when |\n|---|---|---|\n" +
	"| `--max-conns` | 7 | that many open |\n| (accept failing) | | out of descriptors |\n<!-- /flagdoc -->\n"

const want = "# tetherd\n\n<!-- flagdoc:table -->\n| flag | default | meaning |\n|---|---|---|\n" +
	"| `--admin string` | `127.0.0.1:8081` | admin API address; \"off\": none |\n" +
	"| `--io-uring` | `true` | batch through an io_uring |\n" +
	"| `--listeners int` |  | listeners (default: one per CPU) |\n" +
	"| `--max-conns int` | `0` | most connections \\| at once |\n" +
	"| `--worker value` |  | backend worker URL &lt;repeatable&gt; |\n" +
	"<!-- /flagdoc -->\n\nlimits:\n\n" +
	"<!-- flagdoc:rows -->\n| flag | default | trips when |\n|---|---|---|\n" +
	"| `--max-conns` | `0` | that many open |\n| (accept failing) | | out of descriptors |\n<!-- /flagdoc -->\n"

func TestGenerate(t *testing.T) {
	flags, err := parseHelp(help)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Generate(doc, flags)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	if again, err := Generate(got, flags); err != nil || again != got {
		t.Fatalf("not a fixed point: %v\n%s", err, again)
	}
}

func TestGenerateRefuses(t *testing.T) {
	flags, _ := parseHelp(help)
	for _, bad := range []string{
		"<!-- flagdoc:table -->\nno end\n",
		"<!-- flagdoc:rows -->\n| `--gone` | 1 | x |\n<!-- /flagdoc -->\n",
		"<!-- flagdoc:other -->\n<!-- /flagdoc -->\n",
	} {
		if _, err := Generate(bad, flags); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

// TestCheckFailsOnHandEdit: -check passes on a generated file and fails
// (exit 1, naming the file) once a row is edited by hand, in either kind
// of table; without -check the file is written back.
func TestCheckFailsOnHandEdit(t *testing.T) {
	dir := t.TempDir()
	hf, path := filepath.Join(dir, "help"), filepath.Join(dir, "doc.md")
	os.WriteFile(hf, []byte(help), 0o600)
	os.WriteFile(path, []byte(want), 0o600)
	var stderr bytes.Buffer
	if rc := run([]string{"-check", "-help", hf, path}, &stderr); rc != 0 {
		t.Fatalf("generated file: rc %d: %s", rc, stderr.String())
	}
	for _, edit := range [][2]string{
		{"| `--io-uring` | `true` |", "| `--io-uring` | `false` |"},
		{"batch through an io_uring |", "batch through io_uring |"},
		{"| `--max-conns` | `0` | that many open |", "| `--max-conns` | 5000 | that many open |"},
	} {
		edited := strings.Replace(want, edit[0], edit[1], 1)
		if edited == want {
			t.Fatalf("edit %q: not in the file", edit[0])
		}
		os.WriteFile(path, []byte(edited), 0o600)
		stderr.Reset()
		if rc := run([]string{"-check", "-help", hf, path}, &stderr); rc != 1 || !strings.Contains(stderr.String(), path) {
			t.Errorf("hand edit %q: rc %d, %q; want 1 naming the file", edit[1], rc, stderr.String())
		}
		if rc := run([]string{"-help", hf, path}, &stderr); rc != 0 {
			t.Fatalf("write: rc %d", rc)
		}
		if b, _ := os.ReadFile(path); string(b) != want {
			t.Errorf("hand edit %q: not written back:\n%s", edit[1], b)
		}
	}
}

// TestDocsAreTheHelp: the repository's README and docs/operations.md
// tables are what tetherd -h says (what `make vet` checks).
func TestDocsAreTheHelp(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	root := filepath.Join("..", "..")
	out, err := exec.Command("go", "run", filepath.Join(root, "cmd", "tetherd"), "-h").CombinedOutput()
	if err != nil {
		t.Fatalf("tetherd -h: %v\n%s", err, out)
	}
	hf := filepath.Join(t.TempDir(), "help")
	os.WriteFile(hf, out, 0o600)
	var stderr bytes.Buffer
	if rc := run([]string{"-check", "-help", hf, filepath.Join(root, "README.md"), filepath.Join(root, "docs", "operations.md")}, &stderr); rc != 0 {
		t.Fatalf("rc %d: %s", rc, stderr.String())
	}
}
