//go:build race

package deploy

// raceEnabled: built with -race (CPU figures are the detector's).
const raceEnabled = true
