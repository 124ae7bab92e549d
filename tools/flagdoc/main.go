// Command flagdoc writes tetherd's flag tables in the docs from
// `tetherd -h`, so that the help is the one place a flag's text and
// default are written. Between the marker comments
//
//	<!-- flagdoc:table -->  ...  <!-- /flagdoc -->
//
// it writes the whole table (flag, default, meaning: one row per flag);
// between
//
//	<!-- flagdoc:rows -->  ...  <!-- /flagdoc -->
//
// it rewrites the default column (the second) of each table row whose
// first column names a flag (`--name`), keeping the other columns, which
// the docs own; a row naming no flag is kept, one naming an unknown flag
// is an error. With -check it writes nothing and exits 1 when a file
// differs from what it would write (`make vet` runs it).
//
//	go run ./tools/flagdoc [-check] [-help FILE] README.md docs/operations.md
//
// The help is `go run ./cmd/tetherd -h`, or FILE.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

// run is the command: 0 done (or up to date), 1 a file differs (-check)
// or an error.
func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("flagdoc", flag.ContinueOnError)
	fs.SetOutput(stderr)
	check := fs.Bool("check", false, "write nothing; exit 1 if a file differs from tetherd -h")
	helpFile := fs.String("help", "", "read the help from this file instead of running go run ./cmd/tetherd -h")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(err error) int {
		fmt.Fprintln(stderr, "flagdoc:", err)
		return 1
	}
	help, err := readHelp(*helpFile)
	if err != nil {
		return fail(err)
	}
	flags, err := parseHelp(help)
	if err != nil {
		return fail(err)
	}
	status := 0
	for _, path := range fs.Args() {
		old, err := os.ReadFile(path)
		if err != nil {
			return fail(err)
		}
		doc, err := Generate(string(old), flags)
		if err != nil {
			return fail(fmt.Errorf("%s: %w", path, err))
		}
		if doc == string(old) {
			continue
		}
		if *check {
			fmt.Fprintf(stderr, "flagdoc: %s: the flag table differs from tetherd -h; run: go run ./tools/flagdoc %s\n", path, strings.Join(fs.Args(), " "))
			status = 1
			continue
		}
		if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
			return fail(err)
		}
	}
	return status
}

func readHelp(file string) (string, error) {
	if file != "" {
		b, err := os.ReadFile(file)
		return string(b), err
	}
	cmd := exec.Command("go", "run", "./cmd/tetherd", "-h")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go run ./cmd/tetherd -h: %w\n%s", err, out.String())
	}
	return out.String(), nil
}

// Flag is one flag as the help prints it.
type Flag struct {
	Name    string
	Type    string // the placeholder after the name: "duration", "int", "string", "value"; "" for a boolean
	Usage   string
	Default string // "" when the help gives none
}

// parseHelp reads flag.PrintDefaults' output: "  -name type" lines, each
// followed by its usage ("    \t" lines), which ends in " (default X)"
// when the flag has a default of its own.
func parseHelp(help string) ([]Flag, error) {
	var flags []Flag
	for _, line := range strings.Split(help, "\n") {
		switch {
		case strings.HasPrefix(line, "  -"):
			name, typ, _ := strings.Cut(strings.TrimPrefix(line, "  -"), " ")
			flags = append(flags, Flag{Name: name, Type: typ})
		case strings.HasPrefix(line, "    \t"):
			if len(flags) == 0 {
				return nil, errors.New("usage before the first flag")
			}
			f := &flags[len(flags)-1]
			if f.Usage != "" {
				f.Usage += " "
			}
			f.Usage += strings.TrimPrefix(line, "    \t")
		}
	}
	if len(flags) == 0 {
		return nil, errors.New("no flags in the help")
	}
	for i := range flags {
		f := &flags[i]
		if i := strings.LastIndex(f.Usage, " (default "); i >= 0 && strings.HasSuffix(f.Usage, ")") {
			def := f.Usage[i+len(" (default ") : len(f.Usage)-1]
			if f.Type == "string" {
				if s, err := strconv.Unquote(def); err == nil {
					def = s
				}
			}
			f.Usage, f.Default = f.Usage[:i], def
		}
	}
	return flags, nil
}

// defaultCell is a flag's default as a table cell: the help's, or the
// zero of a standard type the help leaves unsaid (unless its usage says
// the default in words: "default: one per CPU").
func (f Flag) defaultCell() string {
	def := f.Default
	if def == "" && !strings.Contains(f.Usage, "default") {
		switch f.Type {
		case "int", "uint":
			def = "0"
		case "duration":
			def = "0s"
		case "":
			def = "false"
		}
	}
	if def == "" {
		return ""
	}
	return "`" + def + "`"
}

// cell escapes what Markdown would read in a table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "<", "&lt;", ">", "&gt;").Replace(s)
}

const (
	beginTable = "<!-- flagdoc:table -->"
	beginRows  = "<!-- flagdoc:rows -->"
	end        = "<!-- /flagdoc -->"
)

// Generate returns doc with its marked flag tables written from flags.
func Generate(doc string, flags []Flag) (string, error) {
	byName := map[string]Flag{}
	for _, f := range flags {
		byName[f.Name] = f
	}
	var out strings.Builder
	rest := doc
	for {
		i := strings.Index(rest, "<!-- flagdoc:")
		if i < 0 {
			out.WriteString(rest)
			return out.String(), nil
		}
		nl := strings.Index(rest[i:], "\n")
		if nl < 0 {
			return "", errors.New("a marker at the end of the file")
		}
		marker := strings.TrimSpace(rest[i : i+nl])
		j := strings.Index(rest[i:], end)
		if j < 0 {
			return "", fmt.Errorf("%s without %s", marker, end)
		}
		body := rest[i+nl+1 : i+j]
		out.WriteString(rest[:i+nl+1])
		switch marker {
		case beginTable:
			out.WriteString(table(flags))
		case beginRows:
			s, err := rows(body, byName)
			if err != nil {
				return "", err
			}
			out.WriteString(s)
		default:
			return "", fmt.Errorf("unknown marker %s", marker)
		}
		out.WriteString(end)
		rest = rest[i+j+len(end):]
	}
}

// table is the whole flag table, one row per flag in the help's order.
func table(flags []Flag) string {
	var b strings.Builder
	b.WriteString("| flag | default | meaning |\n|---|---|---|\n")
	for _, f := range flags {
		name := "--" + f.Name
		if f.Type != "" {
			name += " " + f.Type
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", name, f.defaultCell(), cell(f.Usage))
	}
	return b.String()
}

// rows rewrites the default column of each row naming a flag.
func rows(body string, byName map[string]Flag) (string, error) {
	lines := strings.SplitAfter(body, "\n")
	for k, line := range lines {
		if !strings.HasPrefix(line, "| `--") {
			continue
		}
		cols := strings.Split(strings.TrimRight(line, "\n"), " | ")
		if len(cols) < 3 {
			return "", fmt.Errorf("row %q: want a flag, its default and more columns", line)
		}
		first := strings.TrimPrefix(cols[0], "| `--")
		name, _, _ := strings.Cut(first, "`")
		name, _, _ = strings.Cut(name, " ")
		f, ok := byName[name]
		if !ok {
			return "", fmt.Errorf("row %q: tetherd has no flag --%s", strings.TrimSpace(line), name)
		}
		cols[1] = f.defaultCell()
		lines[k] = strings.Join(cols, " | ") + "\n"
	}
	return strings.Join(lines, ""), nil
}
