// Command importgroups checks that each Go file groups its imports as the
// tree does: the standard library, then third-party modules, then this
// module's own packages, each group separated from the next by a blank
// line, and no group mixing two kinds. `make vet` runs it on the tracked
// files; it names each file and line that breaks the rule and exits 1.
//
// gofmt sorts within a group but never moves an import between groups;
// goimports splits a mixed group but leaves groups in the wrong order or a
// kind split over two groups. This checks all three, with the standard
// library only (no dependency for the module).
//
//	go run ./tools/importgroups [-local module/path] file.go|dir ...
package main

import (
	"bufio"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// The kinds of import, in the order their groups come.
const (
	std = iota
	thirdParty
	local
)

var kindName = [...]string{std: "standard library", thirdParty: "third-party", local: "this module's"}

func main() {
	localPrefix := flag.String("local", "", "this module's import path (default: read from ./go.mod)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: importgroups [-local module/path] file.go|dir ...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *localPrefix == "" {
		p, err := modulePath("go.mod")
		if err != nil {
			fmt.Fprintln(os.Stderr, "importgroups:", err)
			os.Exit(2)
		}
		*localPrefix = p
	}
	args := flag.Args()
	if len(args) == 0 {
		args = []string{"."}
	}
	var files []string
	for _, a := range args {
		st, err := os.Stat(a)
		if err != nil {
			fmt.Fprintln(os.Stderr, "importgroups:", err)
			os.Exit(2)
		}
		if !st.IsDir() {
			files = append(files, a)
			continue
		}
		filepath.WalkDir(a, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && p != a && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "vendor") {
				return filepath.SkipDir
			}
			if !d.IsDir() && strings.HasSuffix(p, ".go") {
				files = append(files, p)
			}
			return nil
		})
	}
	bad := 0
	for _, f := range files {
		problems, err := check(f, *localPrefix)
		if err != nil {
			fmt.Fprintln(os.Stderr, "importgroups:", err)
			os.Exit(2)
		}
		for _, p := range problems {
			fmt.Println(p)
		}
		if len(problems) > 0 {
			bad++
		}
	}
	if bad > 0 {
		fmt.Fprintf(os.Stderr, "importgroups: %d file(s) do not group their imports as standard library, third-party, %s (blank line between groups)\n", bad, *localPrefix)
		os.Exit(1)
	}
}

// modulePath reads the module line of a go.mod.
func modulePath(gomod string) (string, error) {
	f, err := os.Open(gomod)
	if err != nil {
		return "", fmt.Errorf("%v (run from the module root, or pass -local)", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`), nil
		}
	}
	return "", fmt.Errorf("%s: no module line", gomod)
}

func kindOf(path, localPrefix string) int {
	switch {
	case path == localPrefix || strings.HasPrefix(path, localPrefix+"/"):
		return local
	case !strings.Contains(strings.SplitN(path, "/", 2)[0], "."):
		return std // no dot in the first element: the standard library
	}
	return thirdParty
}

// check returns the file's grouping problems, one line each.
func check(name, localPrefix string) ([]string, error) {
	src, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, name, src, parser.ImportsOnly|parser.ParseComments)
	if err != nil {
		return nil, err
	}
	if ast.IsGenerated(f) {
		return nil, nil // bpf2go's output and the like: not ours to arrange
	}
	lines := strings.Split(string(src), "\n")
	blankBetween := func(after, before int) bool { // lines after < l < before, 1-based
		for l := after + 1; l < before; l++ {
			if strings.TrimSpace(lines[l-1]) == "" {
				return true
			}
		}
		return false
	}
	type group struct {
		kinds    map[int]bool
		first    int // line
		firstImp string
	}
	var groups []*group
	for _, d := range f.Decls {
		gd, ok := d.(*ast.GenDecl)
		if !ok || gd.Tok != token.IMPORT {
			continue
		}
		prevEnd := -1
		for _, s := range gd.Specs {
			is := s.(*ast.ImportSpec)
			path, _ := strconv.Unquote(is.Path.Value)
			if path == "C" {
				prevEnd = -1 // cgo's preamble import stands alone
				continue
			}
			start := fset.Position(is.Pos()).Line
			if is.Doc != nil {
				start = fset.Position(is.Doc.Pos()).Line
			}
			if prevEnd < 0 || blankBetween(prevEnd, start) {
				groups = append(groups, &group{kinds: map[int]bool{}, first: fset.Position(is.Pos()).Line, firstImp: path})
			}
			groups[len(groups)-1].kinds[kindOf(path, localPrefix)] = true
			prevEnd = fset.Position(is.End()).Line
		}
	}
	var problems []string
	at := func(line int, format string, a ...any) {
		problems = append(problems, fmt.Sprintf("%s:%d: %s", name, line, fmt.Sprintf(format, a...)))
	}
	last, seen := -1, map[int]bool{}
	for _, g := range groups {
		if len(g.kinds) > 1 {
			var ks []string
			for k := std; k <= local; k++ {
				if g.kinds[k] {
					ks = append(ks, kindName[k])
				}
			}
			at(g.first, "one import group mixes %s imports: a blank line between them", strings.Join(ks, " and "))
			continue
		}
		var k int
		for k = range g.kinds {
		}
		switch {
		case seen[k]:
			at(g.first, "a second group of %s imports (%s): one group each", kindName[k], g.firstImp)
		case k < last:
			at(g.first, "%s imports (%s) after %s ones: standard library, third-party, then %s", kindName[k], g.firstImp, kindName[last], localPrefix)
		}
		seen[k] = true
		last = max(last, k)
	}
	return problems, nil
}
