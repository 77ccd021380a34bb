// An error that becomes an HTTP response: a status and a message naming what to fix.
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace keel::serve {

struct HttpError : std::runtime_error {
  int status;
  nlohmann::json extra;  // more fields of the error object (e.g. the active run's id)
  HttpError(int s, const std::string& msg, nlohmann::json x = nlohmann::json::object())
      : std::runtime_error(msg), status(s), extra(std::move(x)) {}
};

}  // namespace keel::serve
