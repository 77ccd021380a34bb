// An error that becomes an HTTP response: a status and a message naming what to fix.
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace keel::serve {

// The error type of a 403, a refusal that is not about the API key (a path outside the data roots
// or the run): OpenAI's "permission_error" (a wrong key is 401, "authentication_error").
inline nlohmann::json permission_error() { return {{"type", "permission_error"}}; }

struct HttpError : std::runtime_error {
  int status;
  nlohmann::json extra;  // more fields of the error object (e.g. the active run's id)
  HttpError(int s, const std::string& msg, nlohmann::json x = nlohmann::json::object())
      : std::runtime_error(msg), status(s), extra(std::move(x)) {}
};

}  // namespace keel::serve
