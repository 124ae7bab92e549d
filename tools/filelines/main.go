// Command filelines checks that no Go file is over a number of lines
// (default 600): a file that long holds more than one concern, and is
// split into files named by what they hold. Tests are not counted (a
// _test.go file is skipped), nor are generated files (a "Code generated
// ... DO NOT EDIT." comment before the package clause). `make vet` runs it
// on userspace/; it names each file over the limit with its line count
// and exits 1.
//
//	go run ./tools/filelines [-max 600] file.go|dir ...
package main

import (
	"bytes"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	limit := flag.Int("max", 600, "most lines a file may have")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: filelines [-max 600] file.go|dir ...")
		flag.PrintDefaults()
	}
	flag.Parse()
	args := flag.Args()
	if len(args) == 0 {
		args = []string{"."}
	}
	files, err := goFiles(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "filelines:", err)
		os.Exit(2)
	}
	bad := 0
	for _, f := range files {
		n, counted, err := lines(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, "filelines:", err)
			os.Exit(2)
		}
		if counted && n > *limit {
			fmt.Printf("%s: %d lines\n", f, n)
			bad++
		}
	}
	if bad > 0 {
		fmt.Fprintf(os.Stderr, "filelines: %d file(s) over %d lines: split each into files by what they hold\n", bad, *limit)
		os.Exit(1)
	}
}

// goFiles returns the non-test .go files named or under the directories
// named, skipping hidden, testdata and vendor directories.
func goFiles(args []string) ([]string, error) {
	var files []string
	for _, a := range args {
		st, err := os.Stat(a)
		if err != nil {
			return nil, err
		}
		if !st.IsDir() {
			if isSource(a) {
				files = append(files, a)
			}
			continue
		}
		err = filepath.WalkDir(a, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && p != a && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "vendor") {
				return filepath.SkipDir
			}
			if !d.IsDir() && isSource(p) {
				files = append(files, p)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return files, nil
}

func isSource(name string) bool {
	return strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go")
}

// lines returns the file's line count (a last line without a newline
// counts), and whether it counts at all: a generated file does not.
func lines(name string) (n int, counted bool, err error) {
	src, err := os.ReadFile(name)
	if err != nil {
		return 0, false, err
	}
	f, err := parser.ParseFile(token.NewFileSet(), name, src, parser.PackageClauseOnly|parser.ParseComments)
	if err != nil {
		return 0, false, err
	}
	if ast.IsGenerated(f) {
		return 0, false, nil // bpf2go's output and the like
	}
	n = bytes.Count(src, []byte{'\n'})
	if len(src) > 0 && src[len(src)-1] != '\n' {
		n++
	}
	return n, true, nil
}
