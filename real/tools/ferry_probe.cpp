// ferry-probe: measures this device and writes a device profile (docs/devices.md, "Measuring a
// device: ferry probe"). `ferry probe` runs this executable; `ferry-probe --help` lists options.

#include <string>
#include <vector>

#include "ferry/real/probe.hpp"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv, argv + argc);
  return ferry::real::probe_main(args);
}
