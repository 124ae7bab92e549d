// Package config holds tetherd's settings machinery: the declaration of a
// component's settings as flags (flags.go: Setting, Register, Validate,
// Optional, and the help printer) and the optional config file (--config
// FILE, this file): a JSON object whose fields are the command-line
// flags, named exactly like them without the dashes in front:
//
//	{
//	  "listen": "127.0.0.1:8080",
//	  "worker": ["http://10.0.0.5:30001", "http://10.0.0.6:30001"],
//	  "bad-session": "reject",
//	  "health-interval": "5s",
//	  "admin-on-data-port": true
//	}
//
// A flag given on the command line wins over the file. Strings, numbers
// and booleans are passed to the flag as they would be typed; a list sets
// a repeatable flag once per element. An unknown field, a wrong type or a
// value the flag refuses is an error that names the field.
package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
)

// Load reads path and sets every flag of fs it names, except those in
// explicit (the flags given on the command line) and those in deny (flags
// that make no sense in a file, e.g. "config").
func Load(fs *flag.FlagSet, path string, explicit map[string]bool, deny ...string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("config file: %w", err)
	}
	if err := Apply(fs, data, explicit, deny...); err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	return nil
}

// Apply is Load on the file's contents.
func Apply(fs *flag.FlagSet, data []byte, explicit map[string]bool, deny ...string) error {
	var fields map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&fields); err != nil {
		return fmt.Errorf("not a JSON object: %w", err)
	}
	if dec.More() {
		return errors.New("not a JSON object: data after the object")
	}
	if fields == nil {
		return errors.New("not a JSON object")
	}
	names := make([]string, 0, len(fields))
	for name := range fields {
		names = append(names, name)
	}
	sort.Strings(names) // deterministic errors
	denied := map[string]bool{}
	for _, d := range deny {
		denied[d] = true
	}
	for _, name := range names {
		f := fs.Lookup(name)
		if f == nil || denied[name] {
			return fmt.Errorf("field %q: unknown (fields are tetherd's flag names, e.g. \"worker\", \"health-interval\")", name)
		}
		if explicit[name] {
			continue // the command line wins
		}
		values, err := values(fields[name])
		if err != nil {
			return fmt.Errorf("field %q: %w", name, err)
		}
		for _, v := range values {
			if err := fs.Set(name, v); err != nil {
				return fmt.Errorf("field %q: invalid value %q: %w", name, v, err)
			}
		}
	}
	return nil
}

// values turns one JSON value into flag arguments.
func values(raw json.RawMessage) ([]string, error) {
	var v any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	one := func(v any) (string, error) {
		switch x := v.(type) {
		case string:
			return x, nil
		case json.Number:
			return x.String(), nil
		case bool:
			return strconv.FormatBool(x), nil
		case nil:
			return "", errors.New("null is not a value")
		}
		return "", fmt.Errorf("want a string, number or boolean, not %s", kind(v))
	}
	if list, ok := v.([]any); ok {
		out := make([]string, 0, len(list))
		for _, e := range list {
			s, err := one(e)
			if err != nil {
				return nil, fmt.Errorf("list element: %w", err)
			}
			out = append(out, s)
		}
		return out, nil
	}
	s, err := one(v)
	if err != nil {
		return nil, err
	}
	return []string{s}, nil
}

func kind(v any) string {
	switch v.(type) {
	case map[string]any:
		return "an object"
	case []any:
		return "a list"
	}
	return fmt.Sprintf("%T", v)
}
