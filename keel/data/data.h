// The data layer in one include: tokenizer, datasets (built-in arith, text, JSONL), collation and
// the deterministic loader.
#pragma once
#include "keel/data/arith.h"
#include "keel/data/dataset.h"
#include "keel/data/loader.h"
#include "keel/data/tokenizer.h"
