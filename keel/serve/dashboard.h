// The dashboard at `/`: one self-contained page (HTML, CSS and script in one string, no build
// step) that lists runs and shows one live through the API and its events stream; the API key is
// typed into the page and sent as a Bearer header.
#pragma once
#include <string>

namespace keel::serve {

const std::string& dashboard_html();

}  // namespace keel::serve
